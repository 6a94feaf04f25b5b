"""Reward subsystem: answer extraction, math-verify scoring, weighting, the Hydra list group, and the
sandbox against untrusted output. Real math-verify, real worker processes, no mocks.

Worker timeouts are TIMEOUT = 1 s. Tests assert outcomes (scored 0, counted as a timeout or error, the
worker replaced), never wall-clock seconds, which flake on a loaded 2-core machine.
User reward functions live in tests/reward_fixtures.py (tests/ is on sys.path via conftest.py, and
workers inherit the parent's sys.path).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
from dataclasses import dataclass, field

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from rlcli.rewards import (
    RewardConfig,
    RewardManager,
    extract_final_answer,
    group_base,
    store_group_schema,
    validate,
)
from rlcli.rewards.functions import MalformedResponse

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
TIMEOUT = 1.0


@pytest.fixture(scope="module")
def mv():
    """math_verify only, 1/0 mapping, two workers."""
    with RewardManager(RewardConfig(timeout_s=TIMEOUT)) as manager:
        yield manager


def assert_healthy(manager: RewardManager) -> None:
    out = manager(["so \\boxed{\\frac{1}{2}}", "Answer: 3"], ["0.5", "4"])
    assert out.acc.tolist() == [1.0, 0.0]


# -- extraction (in-process, no workers) ----------------------------------------------------------


@pytest.mark.parametrize(
    "response, answer",
    [
        ("x \\boxed{3} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # last box, nested braces
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not groups
        ("work\nAnswer: 42\n", "42"),
        ("work\n**Answer:** $7$.", "7"),  # markdown, a full stop and $ delimiters around a DAPO line
        ("work\n**Answer**: 7", "7"),
        ("Answer: 1\nlater \\boxed{2}", "2"),  # the later of the two forms wins
        ("\\boxed{2}\nAnswer: 1", "1"),
        ("Answer: \\boxed{5}", "5"),
        ("The answer is: 5", None),  # not a line starting with Answer:
        ("so \\boxed{12", None),  # truncated: an unclosed last box is no answer
        ("\\boxed{}", None),
        ("Answer:   ", None),
        ("just 42", None),
    ],
)
def test_extract_final_answer(response, answer):
    assert extract_final_answer(response) == answer


@pytest.mark.parametrize(
    "response, answer",
    [
        ("78", "78"),
        ("The answer is 78.", "78"),
        ("63 + 15 = 78", "78"),
        ("It is -12", "-12"),
        ("1,234 apples", "1234"),
        ("about 3.5", "3.5"),
        ("5 or \\boxed{6}", "6"),  # a box still wins
        ("Answer: 9\nbut 10", "9"),  # and so does an Answer: line
        ("no number here", None),
        ("x2 and v1.5", None),  # digits inside words are not numbers
    ],
)
def test_last_number_mode_reads_a_plain_final_answer(response, answer):
    """reward.answer_format=last_number, for tasks that ask for the number alone; boxed mode ignores them."""
    assert extract_final_answer(response, "last_number") == answer
    if "boxed" not in response and "Answer" not in response:
        assert extract_final_answer(response) is None


def test_last_number_mode_scores_plain_answers_and_keeps_the_sandbox():
    """The issue's three replies to "What is 63 + 15?" score 1 with last_number and 0 by default; hostile
    output is still refused in both modes."""
    replies = ["78", "The answer is 78.", "63 + 15 = 78", "\\boxed{" * 100 + "1" + "}" * 100]
    for fmt, acc in (("last_number", [1.0, 1.0, 1.0, 0.0]), ("boxed", [0.0, 0.0, 0.0, 0.0])):
        with RewardManager(RewardConfig(timeout_s=TIMEOUT, answer_format=fmt, num_workers=1)) as manager:
            out = manager(replies, ["78"] * 4)
        assert out.acc.tolist() == acc, fmt
        assert out.metrics["reward/errors"] == 1  # the deep nesting: refused unparsed


def test_extraction_rejects_deep_nesting():
    with pytest.raises(MalformedResponse, match="nested deeper"):
        extract_final_answer("\\boxed{" * 100 + "1" + "}" * 100)
    assert extract_final_answer("\\boxed{" + "{" * 30 + "1" + "}" * 31) is not None


# -- math-verify scoring --------------------------------------------------------------------------


def test_math_verify_correct_and_incorrect(mv):
    cases = [
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("Answer: 0.5", "\\frac{1}{2}", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("Answer: 1000", "1,000", 1.0),
        ("**Answer:** $\\frac{\\sqrt{2}}{2}$", "\\sqrt{2}/2", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),
        ("first \\boxed{4}, finally \\boxed{3}", "4", 0.0),
        ("Answer: 7", "8", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("the result is 42", "42", 0.0),  # no final-answer format: not rewarded
        ("so \\boxed{42", "42", 0.0),  # truncated
    ]
    out = mv([c[0] for c in cases], [c[1] for c in cases])
    assert out.acc.tolist() == [c[2] for c in cases]
    assert out.score.tolist() == out.acc.tolist()  # 1/0 mapping, weight 1
    assert out.score.dtype == torch.float32 and out.score.shape == (len(cases),)
    assert out.metrics["reward/timeouts"] == 0 and out.metrics["reward/errors"] == 0


def test_weighted_parts_and_dapo_mapping():
    cfg = RewardConfig(
        weights={"math_verify": 1.0, "format": 0.5, "length": 0.25},
        correct_score=1.0,
        incorrect_score=-1.0,
        length_scale=100,
        timeout_s=TIMEOUT,
        num_workers=1,
    )
    responses = ["\\boxed{2}", "Answer: 3", "no answer at all" + "x" * 200]
    with RewardManager(cfg) as manager:
        out = manager(responses, ["2", "2", "2"])
    assert out.acc.tolist() == [1.0, 0.0, 0.0]
    assert out.parts["math_verify"].tolist() == [1.0, 0.0, 0.0]  # raw, before the ±1 mapping
    assert out.parts["format"].tolist() == [1.0, 1.0, 0.0]
    length = [1 - len(r) / 100 if len(r) < 100 else 0.0 for r in responses]
    assert out.parts["length"].tolist() == pytest.approx(length)
    mapped = [1.0, -1.0, -1.0]
    expected = [m + 0.5 * f + 0.25 * ln for m, f, ln in zip(mapped, [1, 1, 0], length)]
    assert out.score.tolist() == pytest.approx(expected)
    assert out.metrics["reward/math_verify"] == pytest.approx(1 / 3)
    assert out.metrics["reward/format"] == pytest.approx(2 / 3)
    assert out.metrics["reward/length"] == pytest.approx(sum(length) / 3)
    assert set(out.metrics) == {
        "reward/math_verify",
        "reward/format",
        "reward/length",
        "reward/timeouts",
        "reward/errors",
        "reward/restarts",
    }


def test_custom_rewards_and_acc_without_math_verify_weight():
    cfg = RewardConfig(
        weights={"format": 1.0, "sevens": 0.5, "explodes": 1.0, "nan": 1.0, "hang": 2.0, "hog": 1.0},
        custom={
            "sevens": "reward_fixtures.count_sevens",
            "explodes": "reward_fixtures.explodes",
            "nan": "reward_fixtures.returns_nan",
            "hang": "reward_fixtures.swallows_timeouts",
            "hog": "reward_fixtures.hogs_memory",
        },
        timeout_s=TIMEOUT,
        num_workers=1,
        memory_mb=512,
    )
    with RewardManager(cfg) as manager:
        out = manager(["\\boxed{77}", "Answer: 7 boom hog"], ["77", "8"])
        assert out.acc.tolist() == [1.0, 0.0]  # computed although math_verify has no weight
        assert "math_verify" not in out.parts
        assert out.parts["sevens"].tolist() == [2.0, 1.0]
        assert out.parts["explodes"].tolist() == [1.0, 0.0]  # raised: 0, counted
        assert out.parts["nan"].tolist() == [0.0, 0.0]  # non-finite: 0, counted
        assert out.parts["hang"].tolist() == [0.5, 0.5]
        assert out.parts["hog"].tolist() == [1.0, 0.0]  # MemoryError under memory_mb: 0, counted
        assert out.score.tolist() == pytest.approx([1 + 1.0 + 1 + 1.0 + 1, 1 + 0.5 + 0 + 1.0 + 0])
        assert out.metrics["reward/errors"] == 2  # one per response with any failed part
        assert out.metrics["reward/restarts"] == 0  # the worker survived all of it

        # A function that swallows the worker's soft timeout is killed at timeout_s + grace, and
        # the worker replaced; the other response of the call is still scored.
        pid = manager.pool.pids()[0]
        out = manager(["\\boxed{1} hang", "\\boxed{1}"], ["1", "1"])
        assert out.score[0].item() == 0.0 and out.acc.tolist() == [0.0, 1.0]
        assert out.metrics["reward/timeouts"] == 1 and out.metrics["reward/restarts"] == 1
        assert manager.pool.pids()[0] != pid


def test_custom_import_failure_is_loud():
    cfg = RewardConfig(weights={"mine": 1.0}, custom={"mine": "reward_fixtures.no_such_fn"}, num_workers=1)
    with RewardManager(cfg) as manager, pytest.raises(RuntimeError, match="reward.custom.mine"):
        manager(["\\boxed{1}"], ["1"])


# -- the sandbox ----------------------------------------------------------------------------------

ADVERSARIAL = {
    "power tower": ("\\boxed{9^{9^{9^{9}}}}", "2"),
    "factorial": ("\\boxed{(10^{10})!}", "2"),
    "boxed 10k deep": ("\\boxed{" * 10_000 + "1" + "}" * 10_000, "1"),
    "braces 10k deep": ("\\boxed{" + "{" * 10_000 + "1" + "}" * 10_001, "1"),
    "200k chars": ("\\boxed{" + "1+" * 100_000 + "1}", "2"),
    "60k-char answer": ("\\boxed{" + "1+" * 30_000 + "1}", "2"),
    "NUL": ("Answer: 5\x00", "5"),
    "NUL in ground truth": ("Answer: 5", "5\x00"),
    "lone surrogate": ("\\boxed{5}\ud800", "5"),
    "invalid UTF-8, surrogateescape": (b"\\boxed{5}\xff\xfe".decode("utf-8", "surrogateescape"), "5"),
    "invalid UTF-8 bytes": (b"\\boxed{5}\xff\xfe", "5"),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_input_scores_zero_within_timeout(mv, name):
    response, truth = ADVERSARIAL[name]
    mv.pool.wait_ready()
    out = mv([response], [truth])  # the outcome, not the seconds: a worker past its timeout is counted
    assert out.score.tolist() == [0.0] and out.acc.tolist() == [0.0]
    assert out.metrics["reward/timeouts"] + out.metrics["reward/errors"] == 1
    assert_healthy(mv)


def test_unbraced_power_tower_is_an_ordinary_wrong_answer(mv):
    # latex2sympy reads 9^9^9^9 left-associatively, ((9^9)^9)^9 = 9^729: cheap and simply wrong.
    out = mv(["\\boxed{9^9^9^9}"], ["2"])
    assert out.score.tolist() == [0.0]
    assert out.metrics["reward/timeouts"] == 0 and out.metrics["reward/errors"] == 0  # wrong, not a failure


def test_soft_timeout_keeps_the_worker(mv):
    mv.pool.wait_ready()
    pids = mv.pool.pids()
    out = mv(["\\boxed{" + "1+" * 30_000 + "1}"], ["2"])
    assert out.metrics["reward/timeouts"] == 1 and out.metrics["reward/restarts"] == 0
    assert mv.pool.pids() == pids


def test_mixed_batch_keeps_order(mv):
    normal = [(f"\\boxed{{{k}}}", str(k if k % 3 else k + 1)) for k in range(12)]
    bad = [ADVERSARIAL["power tower"], ADVERSARIAL["NUL"], ADVERSARIAL["lone surrogate"]]
    batch = normal[:4] + bad[:1] + normal[4:8] + bad[1:] + normal[8:]
    out = mv([b[0] for b in batch], [b[1] for b in batch])
    expected = [float(b in normal and b[0] == f"\\boxed{{{b[1]}}}") for b in batch]
    assert out.acc.tolist() == expected
    assert out.metrics["reward/timeouts"] == 1 and out.metrics["reward/errors"] == 2


def test_killed_worker_is_replaced(mv):
    mv.pool.wait_ready()
    victim = mv.pool.pids()[0]
    os.kill(victim, signal.SIGKILL)
    out = mv([f"Answer: {k}" for k in range(8)], [str(k) for k in range(8)])
    assert out.acc.tolist() == [1.0] * 8
    assert victim not in mv.pool.pids() and out.metrics["reward/restarts"] == 1


@pytest.mark.slow
def test_worker_killed_mid_item_is_retried_once():
    cfg = RewardConfig(
        weights={"slow": 1.0, "die": 1.0},
        custom={"slow": "reward_fixtures.slow", "die": "reward_fixtures.kills_its_worker"},
        timeout_s=5.0,
        num_workers=1,
    )
    with RewardManager(cfg) as manager:
        # An external kill (OOM killer, operator) mid-item: the item is retried and scored.
        manager.pool.wait_ready()
        killer = threading.Timer(0.3, os.kill, (manager.pool.pids()[0], signal.SIGKILL))
        killer.start()
        out = manager(["slow", "\\boxed{1}"], ["1", "1"])
        killer.join()
        assert out.score.tolist() == [2.0, 2.0] and out.acc.tolist() == [0.0, 1.0]
        assert out.metrics["reward/errors"] == 0 and out.metrics["reward/restarts"] == 1
        # An input that kills its worker every time: an error after the second death.
        out = manager(["die", "\\boxed{1}"], ["1", "1"])
        assert out.score.tolist() == [0.0, 2.0]
        assert out.metrics["reward/errors"] == 1 and out.metrics["reward/restarts"] == 2


def test_close_stops_workers():
    manager = RewardManager(RewardConfig(num_workers=2))
    manager.pool.wait_ready()
    procs = [w.proc for w in manager.pool._workers]
    manager.close()
    assert all(p.poll() is not None for p in procs)
    manager.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        manager(["\\boxed{1}"], ["1"])


# -- config ---------------------------------------------------------------------------------------


def test_validate_names_the_key():
    with pytest.raises(
        ValueError, match=r"reward\.weights\.fromat.*valid names: code, format, judge, length, math_verify, reasoning_gym, rm"
    ):
        validate(RewardConfig(weights={"fromat": 1.0}))
    with pytest.raises(ValueError, match=r"reward\.timeout_s=0"):
        validate(RewardConfig(timeout_s=0))
    with pytest.raises(ValueError, match=r"reward\.custom\.mine is never used"):
        validate(RewardConfig(custom={"mine": "pkg.fn"}))
    with pytest.raises(ValueError, match=r"reward\.correct_score"):
        validate(RewardConfig(correct_score=-1.0, incorrect_score=0.0))
    validate(RewardConfig(weights={"mine": 1.0}, custom={"mine": "pkg.fn"}))


@dataclass
class _Root:
    """A root schema wired like rlcli.config.Config: `reward` starts from group_base()."""

    reward: RewardConfig = field(default_factory=group_base)
    seed: int = 0


@pytest.fixture(params=["root_schema_field", "reward_schema_node"])
def config_dir(request, tmp_path):
    shutil.copytree(os.path.join(CONF, "reward"), tmp_path / "reward")
    cs = ConfigStore.instance()
    if request.param == "root_schema_field":  # what rlcli.config.Config does
        cs.store(name="test_rewards_root", node=_Root)
        first = "test_rewards_root"
    else:  # a root without a structured `reward` field
        store_group_schema("test_reward_schema")
        first = "test_reward_schema"
    (tmp_path / "config.yaml").write_text(f"defaults:\n  - {first}\n  - reward: math_verify\n  - _self_\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    "overrides, weights, incorrect",
    [
        ([], {"math_verify": 1.0}, 0.0),
        (
            ["reward=[math_verify,format]", "reward.weights.format=0.1"],
            {"math_verify": 1.0, "format": 0.1},
            0.0,
        ),
        (["reward=format"], {"format": 1.0}, 0.0),  # no math_verify leaking in from a default
        (["reward=[dapo,format]"], {"math_verify": 1.0, "format": 1.0}, -1.0),  # order-independent
        (["reward=[format,dapo]"], {"math_verify": 1.0, "format": 1.0}, -1.0),
        (
            ["reward=[math_verify,length]", "reward.length_target=300"],
            {"math_verify": 1.0, "length": 1.0},
            0.0,
        ),
    ],
)
def test_hydra_list_composition(config_dir, overrides, weights, incorrect):
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    assert OmegaConf.get_type(cfg.reward) is RewardConfig
    assert dict(cfg.reward.weights) == weights
    assert cfg.reward.incorrect_score == incorrect
    reward = OmegaConf.to_object(cfg.reward)
    assert isinstance(reward, RewardConfig)
    validate(reward)


def test_hydra_schema_catches_typos(config_dir):
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        with pytest.raises(Exception, match="timout_s"):
            compose("config", overrides=["reward.timout_s=1"])
        with pytest.raises(Exception, match="timeout_s"):
            compose("config", overrides=["reward.timeout_s=fast"])
        cfg = compose("config", overrides=["+reward.weights.fromat=0.1"])
    with pytest.raises(ValueError, match=r"reward\.weights\.fromat"):
        validate(cfg.reward)
