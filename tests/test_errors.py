"""User errors in one line (issue 25 §2): `rlcli: error: <message>` on stderr, exit status 2, no traceback;
--debug or HYDRA_FULL_ERROR=1 adds the traceback; an internal error keeps its traceback and exits 1."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT


def rlcli(tmp_path, *args, env=None, code=None, python_flags=()):
    cmd = [sys.executable, *python_flags, "-c", code] if code else [sys.executable, "-m", "rlcli.commands.cli"]
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([*cmd, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**environ, **(env or {})})


def assert_one_line(out, needle):
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlcli: error: ") and needle in lines[0], out.stderr


@pytest.mark.parametrize("argv,needle", [
    (["train", "rollout.prompts_per_step=-4"], "rollout.prompts_per_step=-4 must be >= 1"),
    (["train", "steps=-1"], "steps=-1 must be >= 1"),
    (["train", "rollout.n=0"], "rollout.n=0 must be >= 1"),
    (["train", "algo.clip_hihg=0.3"], "error: algo.clip_hihg is not a config key; did you mean algo.clip_high?"),  # no
    # OmegaConf internals (AlgoConfig, full_key) from Hydra's compose error
    (["train", "+algo.clip_hihg=0.3"], "algo.clip_hihg is not a config key (added with +algo.clip_hihg=...?): did "
                                       "you mean algo.clip_high?"),  # `+` gets past Hydra's struct mode
    (["train", "+foo=1"], "foo is not a config key"),
    (["eval", "+eval.szie=4"], "did you mean eval.size?"),
    (["sft", "+model.tiny.hidden=64"], "model.tiny.hidden is not a config key"),
    (["plan", "+hw.zero_stagee=3"], "did you mean hw.zero_stage?"),
    (["train", "model=hf"], "model=hf needs model.path="),
    (["train", "algo=dapoo"], "Available options in 'algo': cispo, dapo"),
    (["train", "rollout.n=many"], "rollout.n"),
    (["eval", "eval.k=0"], "eval.k=0 must be >= 1"),
    (["eval", "hw=cpu_x2", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"], "rlcli eval is one process"),
    (["train", "rollout.tensor_parallel_size=2", "hw=cpu_x2"], "but rollout.engine=hf"),
    (["train", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"], "must divide hw.nproc=1"),
    (["sft", "model.path=/x"], "leave model.path unset"),
    (["plan", "algo.clip_low=2"], "algo.clip_low=2"),
    (["ladder", "nope"], "no ladder 'nope'"),
    (["plot", "/no/such/run"], "no such directory"),
])  # fmt: skip
@pytest.mark.slow
def test_a_user_error_is_one_line_with_exit_status_2(tmp_path, argv, needle):
    out = rlcli(tmp_path, *argv, *([f"hydra.run.dir={tmp_path}/run"] if argv[0] in ("train", "eval", "sft") else []))
    assert_one_line(out, needle)


def test_a_refused_run_leaves_no_run_folder_and_keeps_an_earlier_runs(tmp_path):
    """A run refused by a value check takes back the folder Hydra made for it (its .hydra/ and cli.log), for
    `rlcli train` and `rlcli eval`; a folder that holds anything else (an earlier run's metrics) stays whole."""
    for command in ("train", "eval"):
        out = rlcli(tmp_path, command, "rollout.n=0" if command == "train" else "eval.k=0",
                    f"hydra.run.dir={tmp_path}/{command}")
        assert_one_line(out, "must be >= 1")
        assert not (tmp_path / command).exists()
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text("{}\n")
    assert_one_line(rlcli(tmp_path, "train", "rollout.n=0", f"hydra.run.dir={earlier}"), "must be >= 1")
    assert sorted(p.name for p in earlier.iterdir()) == [".hydra", "cli.log", "metrics.jsonl"]


@pytest.mark.parametrize("how", [["--debug"], {"HYDRA_FULL_ERROR": "1"}])
def test_debug_shows_the_traceback(tmp_path, how):
    flags, env = (how, None) if isinstance(how, list) else ([], how)
    out = rlcli(tmp_path, "train", "rollout.n=0", f"hydra.run.dir={tmp_path}/run", *flags, env=env)
    assert out.returncode == 2 and "Traceback" in out.stderr and "rlcli: error: rollout.n=0" in out.stderr, out.stderr


def test_an_internal_error_keeps_its_traceback_and_exits_1(tmp_path):
    """A ValueError from deeper code is a bug, not a config error (the issue's `max() arg is an empty sequence`)."""
    code = ("import sys, rlcli.config\n"
            "def broken(cfg):\n    max([])\n"
            "rlcli.config.validate = broken\n"
            "from rlcli.commands.cli import main\nmain(sys.argv[1:])\n")
    out = rlcli(tmp_path, "train", f"hydra.run.dir={tmp_path}/run", code=code)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" in out.stderr and "max() arg is an empty sequence" in out.stderr
    assert "rlcli: error:" not in out.stderr


def test_a_refused_run_directory_is_a_user_error(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_2\n")
    assert_one_line(rlcli(tmp_path, "train", f"hydra.run.dir={run}"), "pass resume=auto to continue it")


def test_the_docs_describe_the_failures():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert "# When things go wrong" in text and "rlcli: error:" in text
    assert "docs/troubleshooting.md" in (ROOT / "README.md").read_text()


# ------------------------------------------------------------------- mistakes in what the machine holds (issue 34)
# Each is answered by a file-system look (or one import) before any model, tokenizer or prompt loads: one line,
# exit status 2, in about a second. SMALL keeps a regression cheap: if a check is lost, the run trains one step of
# the random-init tiny model and exits 0, which fails the test in seconds instead of warm-starting for minutes.
SMALL = ["model.warm_start.enabled=false", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=16",
         "data.eval_size=4", "eval.before=false", "save=false", "hw.num_threads=1"]
LOADED = ("memory plan", "rlcli train\n", "rlcli eval\n", "warm start", "Loading weights")
"""What a run prints once it measures prompts or loads a model: none of it may appear before these errors."""
PROBE = ("import sys\nfrom rlcli.commands.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
         "    print('heavy modules:', [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules])\n")
"""`rlcli` (the working folder on sys.path, as under `python -m`) that reports on stdout whether it imported the
model stack: a check that answers before any model or tokenizer loads never needs it."""


def assert_early(out, needle, elapsed, limit=10.0):
    """One line naming `needle`, nothing loaded, within `limit` seconds (generous for a loaded 2-core machine: the
    checks take about a second; loading the tiny model and its prompts takes 8 s or more)."""
    assert_one_line(out, needle)
    assert not [m for m in LOADED if m in out.stdout + out.stderr], out.stdout[-2000:]
    assert "heavy modules: []" in out.stdout, out.stdout[-2000:]
    assert elapsed < limit, f"{elapsed:.1f} s: the check ran after something loaded"


def timed_rlcli(tmp_path, *args, **kw):
    import time

    start = time.monotonic()
    out = rlcli(tmp_path, *args, env={"RLCLI_CACHE": str(tmp_path / "cache"), **kw.pop("env", {})}, code=PROBE, **kw)
    return out, time.monotonic() - start


DATA_MISTAKES = {  # file name, its text, extra overrides, what the one line must say
    "missing file": ("absent.jsonl", None, [], "data file {path} does not exist"),
    "CSV named .jsonl": ("train.jsonl", "prompt,answer\n1+1,2\n2+2,4\n", [], "{key}={path} is not JSON lines"),
    "no answer column": ("train.jsonl", '{"prompt": "1+1"}\n{"prompt": "2+2"}\n', [],
                         "no answer in column 'answer'"),
    "empty file": ("train.jsonl", "", [], "{key}={path}: the file has no rows"),
    "misspelled prompt_key": ("train.jsonl", '{"question": "1+1", "answer": "2"}\n', ["data.prompt_key=questoin"],
                              "did you mean data.prompt_key=question?"),
    "CSV named .parquet": ("train.parquet", "prompt,answer\n1+1,2\n", [], "{key}={path} is not a Parquet file"),
    "bad eval file": ("eval.jsonl", "", ["data.eval_path={path}"], "data.eval_path={path}: the file has no rows"),
}


@pytest.mark.parametrize("case", list(DATA_MISTAKES))
def test_a_data_file_mistake_is_one_line_before_anything_loads(tmp_path, case):
    name, text, extra, needle = DATA_MISTAKES[case]
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    train = tmp_path / "good.jsonl"  # the train file when the eval file is the bad one
    train.write_text("".join(f'{{"prompt": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(8)))
    key = "data.eval_path" if "eval_path" in " ".join(extra) else "data.train_path"
    out, elapsed = timed_rlcli(tmp_path, "train", *SMALL, "data.source=file",
                               f"data.train_path={train if key == 'data.eval_path' else path}",
                               *[x.format(path=path) for x in extra], f"hydra.run.dir={tmp_path}/run")
    assert_early(out, needle.format(path=path, key=key), elapsed)
    if case == "CSV named .jsonl":  # not told to set column keys: told what the suffixes mean
        assert "data.prompt_key" not in out.stderr and ".parquet or .pq = Parquet" in out.stderr
    if case == "missing file":
        assert "point data.train_path at a local" in out.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing frozen, nothing started


def test_rlcli_eval_checks_the_eval_split_file_before_loading(tmp_path):
    (tmp_path / "held.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    out, elapsed = timed_rlcli(tmp_path, "eval", *SMALL, "data.source=file", f"data.train_path={tmp_path}/t.jsonl",
                               f"data.eval_path={tmp_path}/held.jsonl", f"hydra.run.dir={tmp_path}/run")
    assert_early(out, "did you mean data.prompt_key=problem?", elapsed)  # train_path is not read by eval


@pytest.fixture
def checkpoint_dir(tmp_path):
    """A checkpoint as the trainer writes it (checkpoint.write_run_files + write_manifest) after step 4 of a
    10-step SMALL run on one rank, without training: what `rlcli train resume=` checks before anything loads."""
    from conftest import compose

    from rlcli.loop import checkpoint as ckpt

    path = tmp_path / "earlier" / "checkpoints" / "step_4"
    path.mkdir(parents=True)
    cfg = compose(*SMALL, "steps=10", run_dir=str(tmp_path / "earlier"))
    ckpt.write_run_files(str(path), cfg, step=4, world=1, logger_ids={})
    ckpt.write_manifest(str(path))
    return path


@pytest.mark.parametrize("args,needle", [
    (["steps=10", "algo.clip_high=0.28"], "algo.clip_high (0.2 in the checkpoint, 0.28 now)"),
    (["steps=3"], "steps=3 is below the checkpoint's step 4"),
    (["steps=10", "hw=cpu_x2"], "was written by 1 training rank(s), this run has 2: resume with the checkpoint's hw.nproc=1"),
    (["steps=10", "resume={tmp}/nowhere"], "resume={tmp}/nowhere: neither a checkpoint"),
])  # fmt: skip
def test_a_resume_that_cannot_continue_is_one_line_before_the_memory_plan(tmp_path, checkpoint_dir, args, needle):
    args = [a.format(tmp=tmp_path) for a in args]
    resume = [] if any(a.startswith("resume=") for a in args) else [f"resume={checkpoint_dir}"]
    out, elapsed = timed_rlcli(tmp_path, "train", *SMALL, *args, *resume, f"hydra.run.dir={tmp_path}/run")
    assert_early(out, needle.format(tmp=tmp_path), elapsed)


@pytest.mark.parametrize("command", ["eval", "train"])
@pytest.mark.parametrize("path,needle", [
    ("{tmp}/no_model", "model.path={tmp}/no_model has no config.json (it holds README.md)"),
    ("{tmp}/absent", "model.path={tmp}/absent: no such directory"),
    ("Qwen/Qwen2.5-0.5B-Instruct", "runs offline (it downloads nothing): download the model first, `hf download "
                                   "Qwen/Qwen2.5-0.5B-Instruct --local-dir models/qwen2.5-0.5b-instruct`"),
    ("no_model/Qwen-0.5B", "model.path=no_model/Qwen-0.5B: no such directory"),  # ./no_model exists: not a hub id
])  # fmt: skip
def test_a_model_path_without_a_model_is_one_line_before_loading(tmp_path, command, path, needle):
    (tmp_path / "no_model").mkdir()
    (tmp_path / "no_model" / "README.md").write_text("weights elsewhere\n")
    out, elapsed = timed_rlcli(tmp_path, command, *SMALL, "model=hf", f"model.path={path.format(tmp=tmp_path)}",
                               f"hydra.run.dir={tmp_path}/run", env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert_early(out, needle.format(tmp=tmp_path), elapsed)


def test_a_hub_id_in_the_local_cache_passes_the_check_offline(tmp_path, monkeypatch):
    """A hub id whose files the Hugging Face cache holds loads offline: the check lets it through. `rlcli plan`
    does not check at all (a preset's hub id plans from model.arch without weights: tests/test_plan.py)."""
    from omegaconf import OmegaConf

    from rlcli.core.schema import ConfigError
    from rlcli.models.config import check_model_path

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    model = OmegaConf.create({"path": "org/tiny", "tokenizer_path": None})
    check_model_path(model)
    model.path = "org/other"
    with pytest.raises(ConfigError, match="nor a model in the Hugging Face cache"):
        check_model_path(model)


def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    out, elapsed = timed_rlcli(tmp_path, "train", *SMALL, f"hydra.run.dir={tmp_path}/a_file/run")
    assert_early(out, f"hydra.run.dir: cannot create or write the run directory ({tmp_path}/a_file is a file", elapsed)


def test_an_os_error_inside_the_job_stays_an_internal_error(tmp_path):
    """Only Hydra's own work on the run directory is the user's: an OSError from rlcli's code is a bug."""
    code = ("import sys, rlcli.config\n"
            "def broken(cfg):\n    open('/nonexistent/dir/file')\n"
            "rlcli.config.validate = broken\n"
            "from rlcli.commands.cli import main\nmain(sys.argv[1:])\n")
    out = rlcli(tmp_path, "train", f"hydra.run.dir={tmp_path}/run", code=code)
    assert out.returncode == 1 and "Traceback" in out.stderr and "FileNotFoundError" in out.stderr, out.stderr[-3000:]
    assert "rlcli: error:" not in out.stderr


def test_an_unimportable_custom_reward_is_one_line_before_the_model_loads(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "rewards.py").write_text("def brevity(response, ground_truth):\n    return 1.0\n")
    out, elapsed = timed_rlcli(tmp_path, "train", *SMALL, "+reward.custom.brevity=mypkg.rewards.brevety",
                               "+reward.weights.brevity=0.5", f"hydra.run.dir={tmp_path}/run")
    assert_early(out, "reward.custom.brevity='mypkg.rewards.brevety' cannot be imported (AttributeError", elapsed)
    out, elapsed = timed_rlcli(tmp_path, "train", *SMALL, "+reward.custom.brevity=yourpkg.rewards.brevity",
                               "+reward.weights.brevity=0.5", f"hydra.run.dir={tmp_path}/run")
    assert_early(out, "importable from the working folder (a file ./yourpkg/rewards.py)", elapsed)


@pytest.mark.slow
def test_the_docs_custom_reward_example_runs_as_written_from_a_working_folder(tmp_path):
    """docs/usage.md's `rlcli train +reward.custom.brevity=mypkg.rewards.brevity ...` with docs/rewards.md's
    mypkg/rewards.py in the working folder, through an entry point that does not put the working folder on sys.path
    (`python -P`, like the installed `rlcli` script): the main process and the reward workers import it."""
    import json
    import re
    import shlex

    line = next(m for m in re.findall(r"^rlcli train .*\+reward\.custom\..*$", (ROOT / "docs" / "usage.md").read_text(), re.M))
    args = shlex.split(line)[1:]  # train +reward.custom... (the command as the docs write it)
    name, target = next(a.removeprefix("+reward.custom.").split("=", 1) for a in args if a.startswith("+reward.custom."))
    module, _, fn = target.rpartition(".")
    code = re.search(r"```python\n# (\S+\.py)\n(def .*?)```", (ROOT / "docs" / "rewards.md").read_text(), re.S)
    assert code and code.group(1) == module.replace(".", "/") + ".py" and f"def {fn}(" in code.group(2)
    (tmp_path / module.replace(".", "/")).parent.mkdir(parents=True)
    (tmp_path / code.group(1)).write_text(code.group(2))
    out = rlcli(tmp_path, *args, *SMALL, "steps=1", f"hydra.run.dir={tmp_path}/run",
                env={"RLCLI_CACHE": str(tmp_path / "cache")}, code="import sys\nfrom rlcli.commands.cli import main\nmain()",
                python_flags=["-P"])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r[f"reward/{name}"] for r in rows if f"reward/{name}" in r] == [1.0]  # short responses: the worker scored


EXIT = """import atexit, os, sys, threading, time
from rlcli.commands.launch import exit_now
class Teardown:  # collected by the interpreter's teardown of __main__, which exit_now skips
    def __del__(self):
        os.write(2, b" [torn down]")
kept = Teardown()
sink = open(sys.argv[1], "w")  # a buffered file that the atexit handler closes
atexit.register(lambda: (sink.write("closed by atexit"), sink.close()))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
print("buffered stdout", end="")
sys.stderr.write("buffered stderr")
{load}
exit_now({code})
"""


@pytest.mark.parametrize("code,status", [("3", 3), ("None", 0), ("'a message'", 1)])
def test_exit_now_ends_the_process_as_a_normal_exit_would(tmp_path, code, status):
    """rlcli and its workers end with launch.exit_now, without the module teardown: the other threads are joined,
    atexit handlers run (here one closes a buffered file), stdout and stderr are flushed, the status is SystemExit's.
    A process that loaded vLLM exits the usual way, teardown included (its shared memory is released there)."""
    for load in ("", "sys.modules['vllm'] = sys  # as if vLLM were loaded"):
        sink = tmp_path / f"sink{bool(load)}.txt"
        out = subprocess.run([sys.executable, "-c", EXIT.format(load=load, code=code), str(sink)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == status, out.stderr
        assert "buffered stdout" in out.stdout and "thread done" in out.stdout, out  # joined, then flushed
        assert out.stderr.startswith("buffered stderr"), out
        assert sink.read_text() == "closed by atexit"
        assert ("[torn down]" in out.stderr) == bool(load), out.stderr
        if status == 1:
            assert out.stderr.replace(" [torn down]", "").strip().endswith("a message"), out.stderr


def test_exit_now_names_a_thread_that_never_ends_instead_of_waiting_forever(tmp_path):
    """A non-daemon thread still running after the join timeout: one error line naming it, status 1, and the
    process ends (the interpreter's own exit would wait for it forever)."""
    code = ("import threading\nfrom rlcli.commands.launch import exit_now\n"
            "threading.Thread(target=threading.Event().wait, name='forever').start()\nexit_now(0, join_timeout_s=0.5)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("rlcli: error: threads still running 0.5 s after the end, left "
                                                   "behind: forever"), out.stderr


def test_the_tiny_model_refuses_prompts_it_cannot_read_and_trains_on_its_own_format(tmp_path):
    """The warm-started tiny model reads only the embedded task's prompts ('Q: 9+37=?\\nA:'): a file of questions in
    words would train on nothing (reward 0 at every step), so it is refused before loading, naming models that read
    text. The same rows written in its format pass the check and train (a 2-step warm start, one training step)."""
    pairs = [(9, 37), (2, 3), (41, 8), (15, 15)]
    words, own = tmp_path / "words.jsonl", tmp_path / "own.jsonl"
    words.write_text("".join(f'{{"question": "What is {a} + {b}?", "answer": "{a + b}"}}\n' for a, b in pairs))
    own.write_text("".join(f'{{"question": "Q: {a}+{b}=?\\nA:", "answer": "{a + b}"}}\n' for a, b in pairs))
    args = [*SMALL[1:], "data.source=file", "data.prompt_key=question", "data.eval_size=null"]
    out, elapsed = timed_rlcli(tmp_path, "train", *args, f"data.train_path={words}", f"hydra.run.dir={tmp_path}/r1")
    assert_early(out, "reads only its arithmetic prompts", elapsed)
    assert "model=smollm2-135m" in out.stderr and "What is 9 + 37?" in out.stderr
    out, _ = timed_rlcli(tmp_path, "train", *args, f"data.train_path={own}", "model.warm_start.steps=2", "steps=1",
                         f"hydra.run.dir={tmp_path}/r2")
    assert out.returncode == 0 and "done: 1 steps" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "  data           a data file: " in out.stdout  # not the name of the default data group (arith)
