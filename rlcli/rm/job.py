"""The `rlcli rm` Hydra job (rlcli.cli JOBS): validate, check the inputs, resolve `resume`, plan the memory, freeze,
train. Everything before the training is torch-free and answers in about a second."""

from __future__ import annotations

from typing import Any


def rm_job(cfg: Any) -> dict[str, Any]:
    from omegaconf import open_dict

    from rlcli import checkpoint
    from rlcli.cli import _freeze, _run_dir
    from rlcli.config import validate
    from rlcli.metrics import RunLog
    from rlcli.models.config import check_model_path
    from rlcli.rm.config import validate as validate_rm
    from rlcli.rm.pairs import check_pairs
    from rlcli.rm.plan import check_fits, line

    _run_dir(cfg)
    validate(cfg)
    validate_rm(cfg)
    check_model_path(cfg.model)
    check_pairs(cfg.rm)
    resume = checkpoint.resolve(cfg.resume, cfg.run_dir)
    if resume is not None:
        checkpoint.check_compatible(resume, cfg)
    elif cfg.resume is None and checkpoint.latest(cfg.run_dir) is not None:
        raise SystemExit(f"{cfg.run_dir} holds checkpoints of an earlier run: pass resume=auto to continue it, "
                         "or choose another hydra.run.dir for a new run")
    checkpoint.check_space(cfg)
    RunLog(cfg.run_dir)(line(check_fits(cfg)))
    with open_dict(cfg):
        cfg.resume = resume  # the frozen config names the checkpoint itself
    _freeze(cfg)
    from rlcli.rm.train import RewardModelTrainer  # torch: after the checks

    with checkpoint.stop_on_disk_full(cfg):
        return RewardModelTrainer(cfg).fit()
