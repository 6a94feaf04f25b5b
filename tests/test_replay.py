"""rollout.replay (rlcli/rollout/replay.py): earlier informative groups in place of a step's empty ones. The sampler's
rules on hand-made batches (the buffer's bound, its order, its age limit, the recorded log-probs of a replayed group),
then through the trainer: a replayed group trains with its recorded log-probs, and a resumed run equals the straight
one."""

import pytest
import torch
from conftest import compose

from rlcli.config import validate
from rlcli.core.batch import RolloutBatch
from rlcli.core.schema import ConfigError
from rlcli.rollout.replay import ReplayBuffer
from rlcli.rollout.sampler import GroupSampler

G, T = 4, 3


def groups(first_id, scores):
    """A fresh batch of groups with ids first_id, first_id+1, ...: each item of `scores` is one group's G scores (acc
    = score here)."""
    n = len(scores) * G
    s = torch.tensor([x for group in scores for x in group], dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
        response_ids=torch.arange(n * T).view(n, T), response_mask=torch.ones(n, T),
        truncated=torch.zeros(n, dtype=torch.bool),
        group_index=torch.arange(first_id, first_id + len(scores)).repeat_interleave(G),
        answers=["a"] * n, texts=["t"] * n, scores=s, acc=s, stale=torch.zeros(n, dtype=torch.bool))


EMPTY, LOW, HIGH, TOP = [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1], [0, 1, 1, 1]  # score std: 0, .433, .5, .433


class Recorder:
    """record_old_logp: a distinct constant per call (the call number), and the rows it was asked for."""

    def __init__(self):
        self.calls: list[RolloutBatch] = []

    def __call__(self, b):
        self.calls.append(b)
        return torch.full((len(b), b.response_ids.shape[1]), -float(len(self.calls)))


def step(sampler, batch, k, rec):
    out, _, counts = sampler.collect(lambda: batch, rec, k)
    return out, counts


def test_empty_groups_are_replaced_by_the_buffered_groups_of_largest_std_with_their_recorded_log_probs():
    buf = ReplayBuffer(size=2, max_age=4)
    s, rec = GroupSampler(3, False, "acc", 1, False, agree=lambda k: k, replay=buf), Recorder()
    out, counts = step(s, groups(0, [LOW, HIGH, EMPTY]), 0, rec)
    assert torch.equal(out.group_index, groups(0, [LOW, HIGH, EMPTY]).group_index)  # nothing buffered yet
    assert counts["replay/replayed"] == 0 and counts["replay/buffered"] == 2
    assert len(rec.calls) == 1 and sorted(set(rec.calls[0].group_index.tolist())) == [0, 1]  # only the admitted
    out, counts = step(s, groups(10, [EMPTY, TOP, EMPTY]), 1, rec)
    # the two empty groups (10, 12) leave; in come 1 (std .5) then 0 (.433, admitted earlier than 11's .433)
    assert out.group_index.unique().tolist() == [0, 1, 11]
    assert counts["replay/replayed"] == 2 and counts["replay/buffered"] == 1  # 11 admitted after the replay
    replayed = out.select_groups(torch.tensor([0, 1]))
    assert replayed.stale.all() and (replayed.old_logp == -1.0).all()  # recorded at step 0, never again
    assert not out.select_groups(torch.tensor([11])).stale.any()
    assert len(rec.calls) == 2 and rec.calls[1].group_index.unique().tolist() == [11]


def test_the_buffer_never_exceeds_its_size_and_keeps_the_largest_std_newest_first():
    buf = ReplayBuffer(size=3, max_age=100)
    s, rec = GroupSampler(4, False, "acc", 1, False, agree=lambda k: k, replay=buf), Recorder()
    for k in range(6):
        step(s, groups(10 * k, [LOW, TOP, HIGH, LOW]), k, rec)
        assert len(buf) <= 3
    stds = [round(v, 3) for _, v, _ in buf.groups]
    assert sorted(stds, reverse=True) == [0.5, 0.5, 0.5]  # the HIGH groups of the three newest steps
    assert sorted(st for st, _, _ in buf.groups) == [3, 4, 5]


def test_a_group_older_than_max_age_is_never_replayed():
    buf = ReplayBuffer(size=4, max_age=2)
    s, rec = GroupSampler(2, False, "acc", 1, False, agree=lambda k: k, replay=buf), Recorder()
    step(s, groups(0, [HIGH, EMPTY]), 0, rec)  # group 0 admitted at step 0
    out, counts = step(s, groups(10, [EMPTY, EMPTY]), 3, rec)  # age 3 > 2: gone
    assert counts["replay/replayed"] == 0 and 0 not in out.group_index.tolist() and len(buf) == 0
    step(s, groups(20, [HIGH, EMPTY]), 4, rec)
    out, counts = step(s, groups(30, [EMPTY, EMPTY]), 6, rec)  # age 2: still replayable
    assert counts["replay/replayed"] == 1 and 20 in out.group_index.tolist()


def test_a_carried_group_is_not_offered_and_a_replayed_one_is_not_offered_again():
    buf = ReplayBuffer(size=4, max_age=4)
    s, rec = GroupSampler(2, False, "acc", 1, False, agree=lambda k: k, replay=buf), Recorder()
    b = groups(0, [HIGH, TOP])
    b = b.replace(stale=torch.tensor([True] * G + [False] * G), old_logp=torch.zeros(2 * G, T))
    step(s, b, 0, rec)
    assert [g for _, _, rows in buf.groups for g in rows.group_index.unique().tolist()] == [1]
    out, _ = step(s, groups(10, [EMPTY, LOW]), 1, rec)
    assert 1 in out.group_index.tolist()
    assert [g for _, _, rows in buf.groups for g in rows.group_index.unique().tolist()] == [11]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.replay.size=8", "algo.dynamic_sampling=true"], "leaves none"),
    (["rollout.replay.size=8", "algo.group_sampling=false", "algo.adv_estimator=reinforce_pp"], "samples each"),
    (["rollout.replay.max_age=2"], "read only with a replay buffer"),
])
def test_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))


@pytest.mark.slow
def test_a_replayed_group_trains_with_its_recorded_log_probs_and_a_resume_equals_the_straight_run(make_trainer):
    """The tiny random-init model under the count-of-'7's reward over 8 tokens (most groups all 0; the filter reads the score): replay fills empty
    groups from step 2 on; the update's old log-probs of a replayed row are those recorded when it was admitted at
    step 1 (the current policy's differ: step 1 moved it); a run checkpointed after step 2 and resumed equals the
    straight run's step 3 (its buffer restored)."""
    from conftest import stable

    over = ("rollout.replay.size=4", "algo.filter_metric=score", "rollout.max_new_tokens=8", "rollout.overlong_buffer_len=2",
            "save=false", "seed=0")
    t = make_trainer(*over)
    seen = []
    update = t.learner.update
    t.learner.update = lambda b, phase: seen.append(b) or update(b, phase)
    t.train_step(1)
    recorded = {int(rows.group_index[0]): rows.old_logp.clone() for _, _, rows in t.state.replay.groups}
    m2 = t.train_step(2)
    b = seen[1]
    replayed = b.group_index[b.stale].unique().tolist()
    assert m2["replay/replayed"] == len(replayed) > 0
    for g in replayed:
        rows = (b.group_index == g).nonzero().squeeze(-1)
        assert torch.equal(b.old_logp[rows], recorded[g])
        with torch.no_grad():
            now = t.learner.logprobs(b.select(rows))
        assert not torch.equal(now, recorded[g])
    t.state.end_step(2, m2, 1, 3)
    path = t.save_checkpoint()
    buffered = [(s, v, int(rows.group_index[0])) for s, v, rows in t.state.replay.groups]
    m3 = t.train_step(3)
    r = make_trainer(*over, f"resume={path}", run="resumed")
    assert [(s, v, int(rows.group_index[0])) for s, v, rows in r.state.replay.groups] == buffered
    assert stable([r.train_step(3)]) == stable([m3])


def test_one_empty_group_takes_the_buffered_group_of_largest_std():
    buf = ReplayBuffer(size=4, max_age=4)
    s, rec = GroupSampler(3, False, "acc", 1, False, agree=lambda k: k, replay=buf), Recorder()
    step(s, groups(0, [LOW, HIGH, TOP]), 0, rec)  # std .433, .5, .433
    out, counts = step(s, groups(10, [EMPTY, LOW, LOW]), 1, rec)
    assert counts["replay/replayed"] == 1 and out.group_index.unique().tolist() == [1, 11, 12]
    # buffered now: 0, 2 (std .433, step 0) and 11, 12 (.433, step 1): a tie of std goes to the newer
    out, _ = step(s, groups(20, [EMPTY, LOW, LOW]), 2, rec)
    assert out.group_index.unique().tolist() == [11, 21, 22]
