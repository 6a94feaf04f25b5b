"""data.curriculum (rlcli/data/curriculum.py; docs/environments.md, "Curriculum"): the level rule worked by hand (up at
raise_at, down below lower_below, the same between, the window emptied by a change), reasoning-gym's own levels, the
prompts drawn at the current level and the held-out set at the levels named, the state carried through a
checkpoint, the one-line errors, and `rlcli train` on the tiny model raising a level and surviving SIGKILL +
resume=auto bit for bit. Offline; only the end-to-end tests start a model."""

import io
import json
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import compose, metric_rows, policy_tensors, stable
from omegaconf import OmegaConf

from rlcli.core.schema import ConfigError
from rlcli.data import load_split, prompt_stream
from rlcli.data.config import DataConfig, validate
from rlcli.data.curriculum import Curriculum, CurriculumConfig, next_level

rg = pytest.importorskip("reasoning_gym", reason="pip install 'rlcli[reasoning-gym]'")


def rule(window=4, raise_at=0.75, lower_below=0.25, start_level=0):
    return CurriculumConfig(enabled=True, window=window, raise_at=raise_at, lower_below=lower_below,
                            start_level=start_level)


def data_cfg(tasks, curriculum=None, **overrides):
    cfg = OmegaConf.structured(DataConfig(source="reasoning_gym", template="answer_tag", train_size=40, eval_size=10))
    cfg.reasoning_gym.tasks = tasks
    cfg.curriculum = OmegaConf.structured(rule())
    for key, value in (curriculum or {}).items():
        cfg.curriculum[key] = value
    for key, value in overrides.items():
        setattr(cfg, key, value)
    validate(cfg)
    return cfg


def payload_configs(rows):
    return [json.loads(r["answer"])["config"] for r in rows]


def expressions(prompts):
    """The arithmetic of chain_sum prompts: [['12', '+', '3'], ...]."""
    return [re.search(r"problem: (.*?) =", p).group(1).split() for p in prompts]


# ---------------------------------------------------------------------------- the rule, by hand
@pytest.mark.parametrize("level,accuracy,want", [
    (1, 0.75, 2),  # reaches raise_at: up
    (1, 1.0, 2),
    (1, 0.74, 1),  # between the thresholds: the same
    (1, 0.25, 1),  # at lower_below is not below it: the same
    (1, 0.24, 0),  # below lower_below: down
    (3, 1.0, 3),  # at the highest level: stays
    (0, 0.0, 0),  # at level 0: stays
])  # fmt: skip
def test_next_level_goes_up_at_raise_at_down_below_lower_below_and_stays_between(level, accuracy, want):
    assert next_level(level, 3, accuracy, raise_at=0.75, lower_below=0.25) == want


def test_a_full_window_decides_and_a_change_empties_it():
    """window 4, raise_at 0.75, lower_below 0.25; task a has levels 0-2, b 0-1."""
    c = Curriculum({"a": 2, "b": 1}, rule())
    assert c.observe([("a", 1), ("a", 1), ("a", 1)]) == [] and c.levels == {"a": 0, "b": 0}  # 3 < window: no decision
    notes = c.observe([("a", 1), ("b", 0), (None, 1), ("other", 1)])  # a: 4/4 = 1.0; rows of no curriculum task ignored
    assert c.levels == {"a": 1, "b": 0} and c.recent == {"a": [], "b": [0.0]}
    assert notes == ["curriculum: a level 0 -> 1 (accuracy 1.000 over its last 4 episodes; data.curriculum.raise_at=0.75, "
                     "lower_below=0.25)"]
    c.observe([("a", 1), ("a", 1), ("a", 0), ("a", 0)])  # 2/4 = 0.5: between, the same; the window stays full
    assert c.levels["a"] == 1 and c.recent["a"] == [1.0, 1.0, 0.0, 0.0]
    c.observe([("a", 1)])  # the last 4: [1, 0, 0, 1] = 0.5
    assert c.levels["a"] == 1 and c.recent["a"] == [1.0, 0.0, 0.0, 1.0]
    c.observe([("a", 1), ("a", 1)])  # [0, 1, 1, 1] = 0.75 reaches raise_at: up to the highest level, 2
    assert c.levels["a"] == 2 and c.recent["a"] == []
    assert c.observe([("a", 1)] * 4) == [] and c.levels["a"] == 2 and c.recent["a"] == [1.0] * 4  # no level 3
    c.observe([("a", 0)] * 4)  # 0.0 < 0.25: down
    assert c.levels["a"] == 1 and c.recent["a"] == []
    c.observe([("a", 1), ("a", 0), ("a", 0), ("a", 0)])  # 0.25 is not below 0.25: the same
    assert c.levels["a"] == 1
    assert c.observe([("b", 0)] * 3) == [] and c.levels["b"] == 0  # 0.0 < 0.25 at level 0: nowhere lower
    assert c.metrics() == {"curriculum/a/level": 1.0, "curriculum/b/level": 0.0}


def test_a_step_decides_once_on_its_last_window_episodes():
    """Six episodes of one step with window 4: the first two leave the window, the last four (all right) raise; the
    decision waits for four episodes of the new level."""
    c = Curriculum({"a": 5}, rule())
    c.observe([("a", 0), ("a", 0), ("a", 1), ("a", 1), ("a", 1), ("a", 1)])
    assert c.levels["a"] == 1 and c.recent["a"] == []
    c.observe([("a", 0)] * 3)
    assert c.levels["a"] == 1  # 3 episodes at level 1: not yet a window
    c.observe([("a", 0)])
    assert c.levels["a"] == 0


def test_raise_at_zero_is_a_schedule_and_levels_start_at_start_level_clamped():
    c = Curriculum({"a": 3, "b": 1}, rule(window=2, raise_at=0, lower_below=0, start_level=2))
    assert c.levels == {"a": 2, "b": 1}  # b's highest level is 1
    c.observe([("a", 0), ("a", 0), ("b", 0), ("b", 0)])  # every full window raises, whatever the accuracy
    assert c.levels == {"a": 3, "b": 1}


# ---------------------------------------------------------------------------- reasoning-gym's levels
def test_a_level_is_reasoning_gyms_own_configuration_of_it():
    """chain_sum's curriculum: num_terms levels 2..12, num_digits 1..10, each a range from level 0 up to the level;
    count_bits' n (10, 1000, 10^6, 10^8, 2^31-1) keeps an interval (ensure_interval)."""
    from rlcli.data.reasoning_gym import Task, level_config, top_level

    chain_sum = Task("chain_sum", 1.0, {"allow_negation": True})  # a field the curriculum does not set passes through
    assert level_config(chain_sum, 0) == {"allow_negation": True, "min_terms": 2, "max_terms": 2, "min_digits": 1,
                                          "max_digits": 1}
    assert level_config(chain_sum, 2) == {"allow_negation": True, "min_terms": 2, "max_terms": 4, "min_digits": 1,
                                          "max_digits": 3}
    assert level_config(Task("count_bits", 1.0, {}), 0) == {"min_n": 10, "max_n": 1000}
    assert (top_level("chain_sum"), top_level("count_bits"), top_level("spell_backward")) == (10, 4, 4)
    curriculum = rg.factory.create_curriculum("chain_sum")  # the same as reasoning-gym's own call
    curriculum.set_global_level(7)
    made = curriculum.generate_configuration()
    assert level_config(Task("chain_sum", 1.0, {}), 7) == {k: getattr(made, k) for k in level_config(chain_sum, 7)
                                                           if k != "allow_negation"}


def test_training_prompts_are_drawn_at_each_tasks_current_level():
    from rlcli.data.reasoning_gym import Task, level_config

    cfg = data_cfg(["chain_sum", "count_bits"], train_size=40)
    stream, curriculum = prompt_stream(cfg, [], seed=0, rank=0, world=1)
    first = stream.take(8)
    assert {json_config(c) for c in payload_configs(r for r in first if "arithmetic" in r["prompt"])} == {
        json_config(level_config(Task("chain_sum", 1.0, {}), 0))}
    assert all(len(e) == 3 and max(len(x) for x in e[::2]) == 1 for e in expressions(
        [r["prompt"] for r in first if "arithmetic" in r["prompt"]]))  # level 0: two one-digit terms
    curriculum.levels["chain_sum"] = 3
    later = stream.take(16)
    sums = [r for r in later if "arithmetic" in r["prompt"]]
    assert sums and {json_config(c) for c in payload_configs(sums)} == {
        json_config(level_config(Task("chain_sum", 1.0, {}), 3))}
    terms = [e[::2] for e in expressions([r["prompt"] for r in sums])]
    assert all(2 <= len(t) <= 5 and max(map(len, t)) <= 4 for t in terms)  # level 3: 2-5 terms of 1-4 digits
    assert any(len(t) > 2 or max(map(len, t)) > 1 for t in terms)
    bits = [r for r in later if "1 bits" in r["prompt"]]
    assert bits and {json_config(c) for c in payload_configs(bits)} == {'{"max_n": 1000, "min_n": 10}'}  # still 0


def json_config(config):
    return json.dumps(config, sort_keys=True)


def test_the_same_position_and_levels_draw_the_same_prompts_and_the_state_survives_a_checkpoint():
    """A LoopState with a curriculum through torch.save and back: the levels and windows come back, and the restored
    stream draws what the original draws next (its position and its levels decide)."""
    from rlcli.algos.kl import AdaptiveKLController
    from rlcli.loop.state import LoopState
    from rlcli.rollout.sampler import GroupSampler

    cfg = data_cfg(["chain_sum", "count_bits"], {"window": 4, "raise_at": 0.5, "lower_below": 0.0}, train_size=24)

    def fresh():
        prompts, curriculum = prompt_stream(cfg, [], seed=3, rank=0, world=1)
        return LoopState(prompts=prompts, sampler=GroupSampler(2, False, "acc", 1, False), curriculum=curriculum,
                         kl_ctl=AdaptiveKLController(0.1, 6.0, 10000), next_group=0)

    s = fresh()
    s.prompts.take(30)  # into the second epoch
    s.curriculum.observe([("chain_sum", 1), ("chain_sum", 1), ("chain_sum", 0), ("chain_sum", 1), ("count_bits", 1)])
    assert s.curriculum.levels == {"chain_sum": 1, "count_bits": 0}
    s.curriculum.observe([("chain_sum", 1), ("count_bits", 0)])
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    t = fresh()
    assert t.curriculum.levels == {"chain_sum": 0, "count_bits": 0}
    t.load_state_dict(torch.load(buf, weights_only=False))
    assert t.curriculum.levels == {"chain_sum": 1, "count_bits": 0}
    assert t.curriculum.recent == {"chain_sum": [1.0], "count_bits": [1.0, 0.0]}
    assert t.prompts.take(20) == s.prompts.take(20)
    other = fresh().curriculum.state_dict() | {"levels": {"gcd": 0}}
    with pytest.raises(ValueError, match="resume with the same data.reasoning_gym.tasks"):
        t.curriculum.load_state_dict(other)


def test_the_held_out_set_is_fixed_at_the_levels_named_and_no_training_level_draws_a_held_out_question():
    """chain_sum at level 0 has 200 questions (two one-digit terms, + or -): 300 training rows meet most of the 50
    held-out ones, and lose them."""
    from rlcli.data.loaders import LevelPools
    from rlcli.data.reasoning_gym import Task, level_config

    cfg = data_cfg(["chain_sum"], train_size=300, eval_size=50)
    evals, report = load_split(cfg, "eval", seed=0)
    assert report.kept == 50 and report.held_out == 0  # at the eval levels, whole
    assert {json_config(c) for c in payload_configs(evals)} == {json_config(level_config(Task("chain_sum", 1, {}), 0))}
    held_out = {r["prompt"] for r in evals}
    train, report = load_split(cfg, "train", seed=0)
    assert report.held_out > 0 and report.kept == 300 - report.held_out
    assert f"{report.held_out} that are held-out questions dropped" in report.summary()
    pools = LevelPools(cfg, seed=0)
    for level in (0, 1, 2):
        assert not held_out & {r["prompt"] for r in pools(0, level)}, level
    assert {r["prompt"] for r in pools(0, 0)} == {r["prompt"] for r in train}  # the run's first draws: load_split's
    # eval_levels name the held-out levels whatever the training levels (a task it leaves out: the start level)
    named = {"eval_levels": {"chain_sum": 2, "count_bits": 0}}
    rows, _ = load_split(data_cfg(["chain_sum", "count_bits"], named, eval_size=20), "eval", seed=0)
    from_1 = data_cfg(["chain_sum", "count_bits"], named | {"start_level": 1}, eval_size=20)
    assert load_split(from_1, "eval", seed=0)[0] == rows  # start_level 1 moves training, not the held-out set
    configs = {json_config(c) for c in payload_configs(rows)}
    assert configs == {json_config(level_config(Task("chain_sum", 1, {}), 2)), '{"max_n": 1000, "min_n": 10}'}
    partly = data_cfg(["chain_sum", "count_bits"], {"eval_levels": {"chain_sum": 2}, "start_level": 1}, eval_size=20)
    assert {json_config(c) for c in payload_configs(load_split(partly, "eval", seed=0)[0])} == {
        json_config(level_config(Task("chain_sum", 1, {}), 2)), '{"max_n": 1000000, "min_n": 10}'}
    one = data_cfg(["chain_sum", "count_bits"], {"eval_levels": 7}, eval_size=20)  # one level: clamped per task
    assert {json_config(c) for c in payload_configs(load_split(one, "eval", seed=0)[0])} == {
        json_config(level_config(Task("chain_sum", 1, {}), 7)), json_config(level_config(Task("count_bits", 1, {}), 4))}



def test_with_the_curriculum_on_or_off_the_held_out_set_is_the_same_rows():
    """The curriculum-off run given the eval level's config explicitly and the curriculum-on run evaluate the same
    questions, on a task whose small space makes the training rows collide with them (a before/after comparison of
    the two arms compares like with like)."""
    from rlcli.data.reasoning_gym import Task, level_config

    level0 = level_config(Task("chain_sum", 1, {}), 0)
    on = data_cfg(["chain_sum"], {"eval_levels": 0}, train_size=300, eval_size=50)
    off = data_cfg([{"name": "chain_sum", "config": level0}], train_size=300, eval_size=50)
    off.curriculum = OmegaConf.structured(CurriculumConfig())
    for seed in (1, 2):
        held_on, held_off = (load_split(c, "eval", seed=seed)[0] for c in (on, off))
        assert held_on == held_off and len(held_on) == 50, seed
        train_on, train_off = (load_split(c, "train", seed=seed)[0] for c in (on, off))
        assert sorted(map(str, train_on)) == sorted(map(str, train_off)), seed  # the training rows gave way, alike
        assert len(train_on) < 300, seed

# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("overrides,needle", [
    (["data.curriculum.enabled=true"], "data.curriculum.enabled=true needs tasks that declare levels, and "
                                       "data.source=arith has none: use data=reasoning_gym"),
    (["data=reasoning_gym", "data.curriculum.window=8"], "data.curriculum.window=8 is read only with "
                                                         "data.curriculum.enabled=true"),
    (["data=reasoning_gym", "data.curriculum.enabled=true", "data.curriculum.lower_below=0.7"],
     "data.curriculum.lower_below=0.7 must be below data.curriculum.raise_at=0.7"),
    (["data=reasoning_gym", "data.curriculum.enabled=true", "data.curriculum.eval_levels={gcd:1}"],
     "data.curriculum.eval_levels.gcd: 'gcd' is not a task of data.reasoning_gym.tasks"),
    (["data=reasoning_gym", "data.curriculum.enabled=true", "data.curriculum.eval_levels=1.5"],
     "data.curriculum.eval_levels=1.5 must be a whole level"),
    (["data=reasoning_gym", "data.curriculum.enabled=true", "data.curriculum.raise_at=1.5"],
     "data.curriculum.raise_at=1.5 must be in [0, 1]"),
])  # fmt: skip
def test_a_curriculum_config_error_names_the_key_and_the_fix(overrides, needle):
    from rlcli.config import validate as validate_run

    with pytest.raises(ConfigError) as e:
        validate_run(compose(*overrides))
    assert needle in str(e.value)


@pytest.mark.parametrize("tasks,curriculum,needle", [
    (["chain_sum", "acre"], {}, "tasks[1]: reasoning-gym has no curriculum for 'acre', and data.curriculum.enabled=true "
                                "needs one for every task"),
    ([{"name": "chain_sum", "config": {"max_terms": 3}}], {}, "tasks[0].config.max_terms is set by chain_sum's "
                                                             "curriculum at each level"),
    (["survo"], {}, "reasoning-gym's survo curriculum makes at level 2 a config its dataset rejects (AssertionError"),
    (["chain_sum", "count_bits"], {"eval_levels": {"count_bits": 9}},
     "data.curriculum.eval_levels.count_bits=9 is above count_bits's highest level, 4"),
])  # fmt: skip
def test_a_task_the_curriculum_cannot_move_fails_before_anything_loads(tasks, curriculum, needle):
    from rlcli.data.loaders import check_files

    with pytest.raises(ConfigError) as e:
        check_files(data_cfg(tasks, curriculum))
    assert needle in str(e.value)


@pytest.mark.slow
def test_the_cli_refuses_a_task_without_a_curriculum_in_one_line(tmp_path):
    from test_reasoning_gym import one_line_error

    line = one_line_error(tmp_path, "data=reasoning_gym", "model.warm_start.enabled=false",
                          "data.reasoning_gym.tasks=[chain_sum,acre]", "data.curriculum.enabled=true")
    assert "reasoning-gym has no curriculum for 'acre'" in line


def test_the_docs_example_composes_and_its_preset_tasks_need_their_curriculum_fields_free():
    """The preset's basic_arithmetic sets min_terms / max_terms / max_digits, which its curriculum moves."""
    from rlcli.config import validate as validate_run
    from rlcli.data.loaders import check_files

    cfg = compose("data=reasoning_gym", "data.curriculum.enabled=true")
    validate_run(cfg)
    with pytest.raises(ConfigError, match=r"tasks\[1\]\.config\.max_digits is set by basic_arithmetic's curriculum"):
        check_files(cfg.data)


# ---------------------------------------------------------------------------- through the real CLI
RUN = ["data=reasoning_gym", "model.warm_start.enabled=false", "data.reasoning_gym.tasks=[chain_sum]",
       "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=8",
       "reward.num_workers=1", "hw.num_threads=1", "eval.before=false", "optim.lr=1e-3", "logger.rollouts=true",
       "+reward.weights.sevens=1.0", "+reward.custom.sevens=reward_fixtures.count_sevens",
       "data.curriculum.enabled=true", "data.curriculum.window=12", "data.curriculum.raise_at=0",
       "data.curriculum.lower_below=0", "steps=5"]
"""The tiny model at random init (acc 0; the scripted reward `sevens` gives its groups variance to learn from) on
chain_sum with a schedule (raise_at=0): 8 episodes a step against a window of 12, so the level goes up after steps 2
and 4 and a checkpoint at step 3 holds level 1 with 8 episodes in the window."""


@pytest.mark.slow
def test_a_raised_level_survives_sigkill_and_resume_auto_bit_for_bit(tmp_path):
    from metric_names import undocumented
    from test_checkpoint import finish, kill_tree, logged_step, start, train, wait_for

    from rlcli.loop import checkpoint as ckpt

    cache = tmp_path / "cache"
    straight = tmp_path / "straight"
    train(tmp_path, cache, *RUN, "checkpoint.every=0", f"hydra.run.dir={straight}")
    steps = [r for r in metric_rows(straight) if "acc/mean" in r]
    assert [r["curriculum/chain_sum/level"] for r in steps] == [0, 0, 1, 1, 2]  # the level each step drew at
    assert not undocumented({k: v for r in steps for k, v in r.items()}, reward_parts=("reasoning_gym", "sevens"),
                            tasks=("chain_sum",))
    first, last = ([json.loads(line)["prompt"] for line in (straight / "rollouts" / f"step_{s}.jsonl").read_text()
                    .splitlines()] for s in (1, 5))
    assert all(len(e) == 3 and max(map(len, e[::2])) == 1 for e in expressions(first))  # level 0
    terms = [e[::2] for e in expressions(last)]
    assert all(len(t) <= 4 and max(map(len, t)) <= 3 for t in terms)  # level 2: 2-4 terms of 1-3 digits
    assert any(len(t) > 2 or max(map(len, t)) > 1 for t in terms)

    run = tmp_path / "killed"
    proc = start(tmp_path, cache, *RUN, "checkpoint.every=3", f"hydra.run.dir={run}")
    wait_for(logged_step(run, 4), proc)
    kill_tree(proc)
    finish(proc)
    assert ckpt.latest(str(run)) == str(run / "checkpoints" / "step_3")
    saved = torch.load(run / "checkpoints" / "step_3" / "rank_0.pt", weights_only=False)["curriculum"]
    assert saved == {"levels": {"chain_sum": 1}, "recent": {"chain_sum": [0.0] * 8}}
    out = train(tmp_path, cache, *RUN, "checkpoint.every=3", f"hydra.run.dir={run}", "resume=auto")
    assert stable(metric_rows(run)) == stable(metric_rows(straight))
    assert "3 of 5 steps done" in out and "curriculum: chain_sum level 1 -> 2" in out
    a, b = policy_tensors(straight), policy_tensors(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_episodes_read_each_rows_task_and_acc():
    from rlcli.data.reasoning_gym import episodes

    def truth(task):
        return json.dumps({"task": task, "config": {}, "entry": {}})

    batch = SimpleNamespace(answers=[truth("chain_sum"), truth("gcd"), "42"], acc=torch.tensor([1.0, 0.0, 1.0]))
    assert episodes([batch, batch]) == [("chain_sum", 1.0), ("gcd", 0.0), (None, 1.0)] * 2
