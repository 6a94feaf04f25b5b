"""`rlcli <command> [hydra overrides]`: train | sft | eval | plan | ladder | plot | export | explain.

Compose once, freeze, fan out (docs/design.md#config): this process composes the config with Hydra,
validates it, writes run_dir/config.yaml, then trains in-process (hw.nproc == 1) or launches
`hw.nproc` torchrun workers that load the frozen YAML and never run Hydra themselves.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcli.commands.launch import exit_now, freeze, launch, offline_environment, run_dir

COMMANDS = {
    "train": "RL training: rollout -> reward -> shaping -> scoring -> advantage -> update.",
    "eval": "Sample eval.k responses per held-out prompt: acc_avg@k, pass@k, maj@k, length, truncation.",
    "sft": "Supervised warm-start of the embedded tiny model on the embedded task (cached).",
    "rm": "Train a Bradley-Terry reward model from preference pairs (rm=..., docs/reward_models.md).",
    "plan": "Per-device memory of a config (weights ... KV cache) vs the device, and fixes (--help).",
    "explain": "Print every config key with its type, default and meaning (optionally one group).",
    "ladder": "Run a paper's ablation ladder (recipes/<paper>/) over seeds; table + figure (--help).",
    "plot": "Training-curve figure of run or sweep directories (--help).",
    "export": "A run's policy + a model card in a Hugging Face directory; --push uploads it (--help).",
}


def _usage() -> str:
    lines = ["usage: rlcli <command> [key=value ...] [-m] [--cfg job] [--config-dir DIR] [--help]",
             "       rlcli --version", "", "commands:"]
    lines += [f"  {k:<8} {v}" for k, v in COMMANDS.items()]
    lines += ["", "Any config key can be overridden (algo.clip_high=0.28); groups are chosen with",
              "group=option (algo=dapo hw=cpu_x2); `rlcli train --help` lists groups and knobs.",
              "--config-dir DIR adds your own group options (DIR/algo/my_algo.yaml -> algo=my_algo) and recipes",
              "(DIR/recipe/<paper>/NN_<rung>.yaml) to the shipped ones; runs are written under ./runs/."]
    return "\n".join(lines)


def check_inputs(cfg: Any, splits: tuple[str, ...]) -> None:
    """What this machine must hold for `rlcli train` / `rlcli eval`, checked in about a second before anything
    loads (`rlcli plan` needs none of it): the model directory (or a cached hub id), the data files (format and
    columns of their first rows), the reward.custom functions (importable), reward.rm.path (a reward model's
    directory, with reward=rm), reward.judge (its API key's variable, a local judge's directory; the server is not
    asked). A ConfigError names the key."""
    from rlcli.data.loaders import check_files
    from rlcli.models.checks import check_teacher
    from rlcli.models.config import check_model_path
    from rlcli.rewards.config import check_importable, check_judge, check_reward_model

    check_model_path(cfg.model)
    check_files(cfg.data, splits, *tiny_reads(cfg))
    check_importable(cfg.reward)
    check_reward_model(cfg.reward)
    check_judge(cfg.reward)
    if "train" in splits:
        check_teacher(cfg)


def tiny_reads(cfg: Any) -> tuple[Any, str] | tuple[()]:
    """What the warm-started embedded tiny model can read of a data file: (a check of one prompt, the refusal with
    the fix), or () for any other model (a random-init tiny model, model.warm_start.enabled=false, trains on
    anything a user reward scores)."""
    m = cfg.model
    if m.path is not None or m.gguf_file is not None or not m.warm_start.enabled:
        return ()
    from rlcli.data import arith
    from rlcli.data.templates import render_prompt

    return (lambda prompt: arith.reads(render_prompt(prompt, cfg.data.template, False)),
            "the embedded tiny model (model=tiny, the default) reads only its arithmetic prompts, 'Q: 12+34=?\\nA:', "
            "and none of the first rows is one: it would train on nothing. Train a model that reads text "
            "(model=smollm2-135m, or model=hf model.path=<a Hugging Face model directory>), or write the prompts as "
            "'Q: a+b=?\\nA:'")


HYDRA_LEFTOVERS = {".hydra", "cli.log"}
"""What Hydra writes into a run directory before the job starts: the composed config and the job's log."""


@contextlib.contextmanager
def refused_leaves_nothing(out_dir: str) -> Iterator[None]:
    """A run refused here (a config error, a value check, unreadable data: raised before any compute) takes back
    the run directory Hydra made for it, when it holds nothing but HYDRA_LEFTOVERS: no empty run folders. A folder
    with anything else in it (an earlier run's checkpoints or metrics) is left as it is, and so is a sweep's trial
    (the sweep records the failure in it, trial.json, and its summary reads the trial's overrides there)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    trial = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        yield
    except (SystemExit, Exception):
        out = Path(out_dir)
        if not trial and out.is_dir() and {p.name for p in out.iterdir()} <= HYDRA_LEFTOVERS:
            shutil.rmtree(out, ignore_errors=True)
        raise


def train_job(cfg: Any) -> dict[str, Any] | None:
    """One Hydra job: validate, check the inputs, resolve `resume` (and check the checkpoint's config against this
    one), plan the memory, freeze, then train here or launch workers."""
    from omegaconf import open_dict

    from rlcli.config import validate
    from rlcli.loop import checkpoint
    from rlcli.loop.metrics import RunLog
    from rlcli.plan.report import check_fits, fits_line

    with refused_leaves_nothing(run_dir(cfg)):
        validate(cfg)
        check_inputs(cfg, ("train", "eval"))
        resume = checkpoint.resume_point(cfg)  # before the memory plan, which tokenises every prompt
        if resume is not None:
            checkpoint.adopt(resume, cfg.run_dir)  # e.g. the judge's cached replies, into a branch's new run directory
        elif cfg.resume == "auto":
            RunLog(cfg.run_dir)(f"resume=auto: no checkpoint in {checkpoint.root(cfg.run_dir)} yet, starting fresh")
        checkpoint.check_space(cfg)  # room for one checkpoint, before anything is loaded
        plan = check_fits(cfg)  # the memory plan (`rlcli plan`) on the data's real lengths, before any weights load
    if plan is not None:
        RunLog(cfg.run_dir)(fits_line(plan))  # the terminal and cli.log, like everything the run prints
    with open_dict(cfg):
        cfg.resume = resume  # the frozen config names the checkpoint itself
    frozen = freeze(cfg)
    if cfg.hw.nproc * cfg.hw.nnodes == 1:
        from rlcli.loop.trainer import Trainer

        with checkpoint.stop_on_disk_full(cfg):
            return Trainer(cfg).fit()
    # Work one rank would do alone (the tiny model's warm start, a model conversion) happens here, before the
    # workers start: they then read the cache, and no rank waits for it under hw.collective_timeout_s.
    from rlcli.models import resolve_model_path

    resolve_model_path(cfg.model, cfg.data)
    return launch(frozen, cfg.hw)


def sft_job(cfg: Any) -> dict[str, Any]:
    from rlcli.commands.sft import sft_job as job

    return job(cfg)


def eval_job(cfg: Any) -> dict[str, float]:
    from rlcli.config import validate

    with refused_leaves_nothing(run_dir(cfg)):
        validate(cfg)
        check_inputs(cfg, ("eval",))
    from rlcli.loop.eval import run_eval  # torch: after the checks, which answer in a second

    return run_eval(cfg)


def rm_job(cfg: Any) -> dict[str, Any]:
    from rlcli.commands.rm import rm_job as job

    return job(cfg)


JOBS = {"train": train_job, "sft": sft_job, "eval": eval_job, "rm": rm_job}


def _hydra_main(command: str, argv: list[str]) -> None:
    import hydra

    from rlcli.config import CONF_DIR, register_configs
    from rlcli.core import sweep

    job = JOBS[command]

    from_job: list[BaseException] = []

    @hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
    def entry(cfg: Any) -> float | None:
        """One job. Under -m (a trial of a sweep) `train` returns sweep.objective to the sweeper, and a failure of the
        job (a user's mistake or a crash) is recorded and raised as TrialFailed, so the other trials run (rlcli.core.sweep)."""
        import traceback

        multirun = sweep.in_multirun()
        try:
            job(cfg)
            return sweep.finished(cfg) if multirun and command == "train" else None
        except Exception as e:  # a user's mistake leaves the job as SystemExit, which Hydra does not report
            message = user_message(e)
            if message is None:
                if multirun:  # an internal error: its traceback, then the trial fails
                    traceback.print_exc()
                    raise sweep.failed(f"{type(e).__name__}: {e}") from e
                from_job.append(e)
                raise
            if DEBUG:
                traceback.print_exc()
            if multirun:
                raise sweep.failed(message) from e
            raise SystemExit(message) from e
        except SystemExit as e:  # rlcli's own refusals, and workers that failed
            if not multirun or sweep.stopped_by_signal(e):
                raise
            raise sweep.failed(e.code if isinstance(e.code, str) else f"exit code {e.code}") from e

    if command != "train" and not any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in argv):
        argv = [f"hydra.run.dir=runs/{command}/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}", *argv]
    sweep.check_plugins(argv)
    if "hydra/sweeper=optuna" in argv:
        argv = sweep.optuna_overrides(argv)
    register_configs(argv)
    sys.argv = [f"rlcli {command}", *argv]
    # Hydra would print errors itself (a shortened traceback, exit 1); let them reach main(), which prints a
    # user's mistake in one line and an internal error with its full traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        entry()
    except sweep.TrialFailed as e:  # the basic sweeper raises the first failed job's error once every job has run
        if e.sweep_dir:
            print(sweep.summary(e.sweep_dir), flush=True)
        print(f"rlcli: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from e
    except ValueError as e:
        if not sweep.all_failed(e):
            raise
        print("rlcli: error: every trial of the sweep failed (each trial's trial.json holds its error)",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from e
    except OSError as e:
        if any(e is raised for raised in from_job) or e.filename is None:
            raise
        raise _run_dir_error(e, "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir") from e


def _run_dir_error(e: OSError, key: str) -> Exception:
    """An OSError of Hydra's own work before the job (creating the run directory, writing .hydra/ and the log in
    it) as a one-line error naming `key`; the nearest existing part of the path that is a file, if any, is the
    usual cause (a run directory under a file)."""
    from rlcli.core.schema import ConfigError

    blocker = Path(os.fsdecode(e.filename))
    while not blocker.exists() and blocker != blocker.parent:
        blocker = blocker.parent
    why = (f"{blocker} is a file, not a directory" if blocker.is_file()
           else f"{e.strerror or type(e).__name__}: {os.fsdecode(e.filename)}")
    return ConfigError(f"{key}: cannot create or write the run directory ({why}): choose a {key} that can be "
                       f"created and written, e.g. {key}=runs/my_run")


def main(argv: list[str] | None = None) -> None:
    """Run a command. A user's mistake (a config error, a typo Hydra reports, a refused run directory) is printed
    as one line, `rlcli: error: <message>`, with exit status 2; `--debug` or HYDRA_FULL_ERROR=1 adds the
    traceback. Anything else is an internal error: its traceback, exit status 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    global DEBUG
    debug = DEBUG = "--debug" in argv or os.environ.get("HYDRA_FULL_ERROR") == "1"
    argv = [a for a in argv if a != "--debug"]
    try:
        _main(argv)
    except SystemExit as e:
        if isinstance(e.code, str):  # raise SystemExit("message"): rlcli's own refusals, ladder's and plot's
            _user_error(e.code, debug)
        raise
    except Exception as e:
        message = user_message(e)
        if message is None:
            raise
        _user_error(message, debug)


def run() -> None:
    """The `rlcli` program (and `python -m rlcli`): main(), then launch.exit_now, which skips the interpreter's
    teardown of torch and the rest (1.3 s) after what a normal exit does."""
    try:
        main()
    except SystemExit as e:
        exit_now(e.code)
    exit_now(0)


DEBUG = False
"""--debug or HYDRA_FULL_ERROR=1: user errors come with their traceback."""


def user_message(e: BaseException) -> str | None:
    """The one-line message of a user's mistake, or None for an internal error."""
    from hydra.errors import HydraException

    from rlcli.core.schema import ConfigError

    if isinstance(e, ConfigError):
        return str(e)
    if isinstance(e, HydraException):  # composing: a misspelled key or option, a wrong type, a bad override
        parts = [str(e)] + ([str(e.__cause__)] if e.__cause__ is not None else [])
        lines = [line.strip() for part in parts for line in part.splitlines() if line.strip()]
        # Hydra's "To append to your config use +key=value" is the wrong fix for a typo in a typed schema.
        noise = ("To append to your config", "reference_type=", "object_type=", "Config search path", "provider=")
        lines = [line for line in lines if not line.startswith(noise)]
        options = next((i for i, line in enumerate(lines) if line.startswith("Available options")), None)
        if options is not None:  # one option per line in Hydra's text
            lines = [*lines[:options], lines[options] + " " + ", ".join(lines[options + 1:])]
        import re

        typo = re.search(r"full_key: (\S+)", str(e.__cause__ or e))
        if typo and "not in" in str(e.__cause__ or e):
            import difflib

            from rlcli.config import Config
            from rlcli.schema_doc import knobs

            close = difflib.get_close_matches(typo.group(1), [k for k, *_ in knobs(Config)], n=1)
            # Hydra's text names OmegaConf's internals (the schema's class, full_key): one sentence says it all
            lines = [f"{typo.group(1)} is not a config key", *([f"did you mean {close[0]}?"] if close else [])]
        return "; ".join(dict.fromkeys(lines)) + " (`rlcli explain <group>` lists the keys, `rlcli train --help` the options)"
    return None


def _user_error(message: str, debug: bool) -> None:
    import traceback

    if debug and sys.exc_info()[0] is not None and not isinstance(sys.exc_info()[1], SystemExit):
        traceback.print_exc()
    print(f"rlcli: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _main(argv: list[str]) -> None:
    offline_environment()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"rlcli {version('rlcli')}")
        return
    command, rest = argv[0], argv[1:]
    if command == "explain":
        from rlcli.config import CONF_DIR
        from rlcli.schema_doc import explain_command

        print(explain_command(rest[0] if rest else None, CONF_DIR))
        return
    if command == "plan":  # composes without a run directory: nothing is written
        from rlcli.commands import rm_plan as plan_rm
        from rlcli.plan import report

        # `rlcli plan rm ...`: the reward model `rlcli rm ...` would train
        code = plan_rm.main(rest[1:]) if rest[:1] == ["rm"] and not {"--help", "-h"} & set(rest) else report.main(rest)
        if code:
            raise SystemExit(code)
        return
    if command in ("ladder", "plot", "export"):  # own argparse flags; they launch or read `train` runs
        from rlcli.commands import export, ladder
        from rlcli.loop import plot

        code = {"ladder": ladder.main, "plot": plot.main, "export": export.main}[command](rest)
        if code:
            raise SystemExit(code)
        return
    if command not in JOBS:
        raise SystemExit(f"unknown command {command!r}\n\n{_usage()}")
    if "--help" in rest or "-h" in rest:
        from rlcli.config import CONF_DIR
        from rlcli.schema_doc import help_text

        print(help_text(command, COMMANDS[command], CONF_DIR))
        return
    _hydra_main(command, rest)


if __name__ == "__main__":
    run()
