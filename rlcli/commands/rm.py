"""The `rlcli rm` Hydra job (rlcli.commands.cli JOBS): validate, check the inputs, resolve `resume`, plan the memory, freeze,
train here (one rank) or launch `hw.nproc` torchrun workers (rlcli.commands.worker) as `rlcli train` does. Everything before
the training is torch-free and answers in about a second."""

from __future__ import annotations

from typing import Any


def rm_job(cfg: Any) -> dict[str, Any]:
    from omegaconf import open_dict

    from rlcli.commands.launch import freeze, run_dir
    from rlcli.commands.rm_plan import check_fits, line
    from rlcli.config import validate
    from rlcli.loop import checkpoint
    from rlcli.loop.metrics import RunLog
    from rlcli.models.config import check_model_path
    from rlcli.rm.config import validate as validate_rm
    from rlcli.rm.pairs import check_pairs

    run_dir(cfg)
    validate(cfg)
    validate_rm(cfg)
    check_model_path(cfg.model)
    check_pairs(cfg.rm)
    resume = checkpoint.resume_point(cfg)
    checkpoint.check_space(cfg)
    RunLog(cfg.run_dir)(line(check_fits(cfg)))
    with open_dict(cfg):
        cfg.resume = resume  # the frozen config names the checkpoint itself
    frozen = freeze(cfg)
    if cfg.hw.nproc * cfg.hw.nnodes > 1:
        return _launch(cfg, frozen)
    from rlcli.rm.train import RewardModelTrainer  # torch: after the checks

    with checkpoint.stop_on_disk_full(cfg):
        return RewardModelTrainer(cfg).fit()


def _launch(cfg: Any, frozen: str) -> None:
    """Several ranks: what one rank would do alone (the warm start, a conversion, rm.source=samples' sampling)
    happens here, before the workers start, which then read the caches; then `hw.nproc` torchrun workers train."""
    from rlcli.commands.launch import launch
    from rlcli.models import resolve_model_path

    model_path = resolve_model_path(cfg.model, cfg.data)[0]
    if cfg.rm.source == "samples":
        from rlcli.rm.samples import sample_pairs

        sample_pairs(cfg, model_path)
    launch(frozen, cfg.hw, job="rm")
