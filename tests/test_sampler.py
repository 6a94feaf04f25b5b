"""Whole-group sampling, DAPO dynamic sampling and the carry, on plain tensors (no model).

Batches are built by hand: group g has G = 2 rows whose `acc` is given per group, so which groups are
informative (0 < #correct < G) is known. `record_old_logp` stands for "the log-probs of the policy
that is current now": a constant per policy version, so the test can see which policy scored a row.
"""

import pytest
import torch

from rlcli.core.batch import RolloutBatch
from rlcli.rollout.sampler import DynamicSamplingExhausted, GroupSampler, informative_groups, sampling_metrics


def batch(group_ids, accs, t=3):
    """Two rows per group; accs[i] = (acc of row 0, acc of row 1) of group group_ids[i]."""
    n = 2 * len(group_ids)
    acc = torch.tensor([a for pair in accs for a in pair], dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
        response_ids=torch.ones(n, t, dtype=torch.long), response_mask=torch.ones(n, t),
        truncated=torch.zeros(n, dtype=torch.bool), group_index=torch.tensor(group_ids).repeat_interleave(2),
        answers=["1"] * n, texts=["x"] * n, scores=acc.clone(), acc=acc, loss_mask=torch.ones(n, t),
        stale=torch.zeros(n, dtype=torch.bool),
    )


def test_informative_groups_keep_mixed_groups_and_singletons_in_order():
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    group_index = torch.tensor([7, 7, 3, 3, 5, 5, 9, 9, 4])  # 7 mixed, 3 all right, 5 all wrong, 9 mixed, 4 alone
    assert informative_groups(values, group_index).tolist() == [7, 9, 4]


class Policy:
    """record_old_logp of the policy version `version` (its log-probs are all equal to -version)."""

    def __init__(self):
        self.version, self.scored_rows = 1, 0

    def __call__(self, b):
        self.scored_rows += len(b)
        return torch.full_like(b.response_mask, -float(self.version))


def test_a_group_carried_twice_keeps_the_log_probs_of_the_policy_that_sampled_it():
    """verl's 3xP generation batch: P = 1 informative group needed, 3 found. Step 1 trains on one and
    carries two, scored by policy 1. Step 2 needs no generation: it trains on one carried group and
    carries the other again, after policy 2 was applied. That group's old log-probs must still be
    policy 1's (the ratio is pi_now / pi_sampler), and no stale row is re-scored."""
    policy = Policy()
    s = GroupSampler(need=1, dynamic=True, filter_metric="acc", max_gen_batches=3, train_on_partial=False)
    fresh = iter([batch([10, 11, 12], [(1, 0), (0, 1), (1, 0)])])
    b1, pool, m1 = s.collect(lambda: next(fresh), policy)
    assert b1.groups.tolist() == [10] and not b1.stale.any() and b1.old_logp is None
    assert s.carry.groups.tolist() == [11, 12] and s.carry.stale.all()
    assert torch.equal(s.carry.old_logp, torch.full((4, 3), -1.0)) and policy.scored_rows == 4
    assert m1 == {"dynamic_sampling/gen_batches": 1.0, "dynamic_sampling/generated_groups": 3.0,
                  "dynamic_sampling/kept_groups": 3.0, "dynamic_sampling/carried": 0.0}
    policy.version = 2  # the optimizer step of step 1
    b2, pool2, m2 = s.collect(lambda: pytest.fail("the carry already holds P groups"), policy)
    assert b2.groups.tolist() == [11] and b2.stale.all()
    assert torch.equal(b2.old_logp, torch.full((2, 3), -1.0))
    assert s.carry.groups.tolist() == [12]
    assert torch.equal(s.carry.old_logp, torch.full((2, 3), -1.0)), "carried twice: still policy 1's log-probs"
    assert policy.scored_rows == 4, "stale rows are never re-scored"
    assert len(pool2) == 0 and m2["dynamic_sampling/carried"] == 2.0 and m2["dynamic_sampling/gen_batches"] == 0.0


def test_mixed_surplus_scores_only_its_fresh_rows():
    policy = Policy()
    s = GroupSampler(need=1, dynamic=True, filter_metric="acc", max_gen_batches=3, train_on_partial=False)
    s.carry = batch([1], [(1, 0)]).replace(stale=torch.ones(2, dtype=torch.bool), old_logp=torch.full((2, 3), -7.0))
    s.need = 2
    fresh = iter([batch([2, 3], [(0, 1), (1, 0)])])
    policy.version = 9
    b, _, m = s.collect(lambda: next(fresh), policy)
    assert b.groups.tolist() == [1, 2] and b.stale.tolist() == [True, True, False, False]
    assert s.carry.groups.tolist() == [3] and torch.equal(s.carry.old_logp, torch.full((2, 3), -9.0))
    assert m["dynamic_sampling/carried"] == 1.0 and m["dynamic_sampling/kept_groups"] == 2.0


def test_refills_until_enough_and_fails_with_the_fix_when_the_cap_is_hit():
    batches = iter([batch([1, 2], [(1, 1), (0, 1)]), batch([3, 4], [(0, 0), (1, 0)])])
    s = GroupSampler(need=2, dynamic=True, filter_metric="acc", max_gen_batches=2, train_on_partial=False)
    b, pool, m = s.collect(lambda: next(batches), Policy())
    assert b.groups.tolist() == [2, 4] and sum(map(len, pool)) == 8 and s.carry is None
    assert m["dynamic_sampling/gen_batches"] == 2.0 and m["dynamic_sampling/generated_groups"] == 4.0
    dead = GroupSampler(need=2, dynamic=True, filter_metric="acc", max_gen_batches=2, train_on_partial=False)
    with pytest.raises(DynamicSamplingExhausted, match="algo.max_gen_batches=2.*algo.train_on_partial=true"):
        dead.collect(lambda: batch([1], [(1, 1)]), Policy())


def test_ranks_agree_on_the_group_count_under_train_on_partial():
    """This rank found 2 informative groups, the other rank only 1 (`agree` returns the minimum over
    ranks): both train on 1 group, so both run the same optimizer steps; the surplus is carried."""
    s = GroupSampler(need=3, dynamic=True, filter_metric="acc", max_gen_batches=1, train_on_partial=True,
                     agree=lambda k: min(k, 1))
    b, _, _ = s.collect(lambda: batch([1, 2, 3], [(1, 0), (0, 1), (1, 1)]), Policy())
    assert b.groups.tolist() == [1] and s.carry.groups.tolist() == [2]
    # Nothing kept anywhere: fail even with train_on_partial (there is nothing to train on).
    none = GroupSampler(need=3, dynamic=True, filter_metric="acc", max_gen_batches=1, train_on_partial=True,
                        agree=lambda k: min(k, 0))
    with pytest.raises(DynamicSamplingExhausted, match=r"found only 0 .* \(on the rank with fewest; this rank: 1\)"):
        none.collect(lambda: batch([1], [(1, 0)]), Policy())


def test_without_dynamic_sampling_one_batch_is_the_step():
    s = GroupSampler(need=2, dynamic=False, filter_metric="acc", max_gen_batches=1, train_on_partial=False)
    b, pool, m = s.collect(lambda: batch([1, 2], [(1, 1), (0, 0)]), Policy())
    assert b.groups.tolist() == [1, 2] and s.carry is None and m["dynamic_sampling/gen_batches"] == 1.0


def test_micro_batches_pack_rows_by_length_within_both_caps_and_cover_each_row_once():
    """Learner.micro_batches: rows longest first, at most hw.micro_batch rows and
    hw.max_tokens_per_micro_batch slots (rows x (longest prompt + longest response)) per micro-batch,
    every row exactly once; trimming leaves less padding than the unsorted split of the same sizes."""
    from types import SimpleNamespace

    from rlcli.loop.learner import Learner

    torch.manual_seed(0)
    n, tp, t = 40, 12, 30
    plen, rlen = torch.randint(1, tp + 1, (n,)), torch.randint(1, t + 1, (n,))
    b = RolloutBatch(
        prompt_ids=torch.zeros(n, tp, dtype=torch.long), prompt_mask=(torch.arange(tp) >= tp - plen[:, None]).long(),
        response_ids=torch.zeros(n, t, dtype=torch.long), response_mask=(torch.arange(t) < rlen[:, None]).float(),
        truncated=torch.zeros(n, dtype=torch.bool), group_index=torch.arange(n), answers=[""] * n, texts=[""] * n,
    )
    trainer = SimpleNamespace(cfg=SimpleNamespace(hw=SimpleNamespace(micro_batch=8, max_tokens_per_micro_batch=120)),
                              lockstep=False, share=False)  # a forward per row (shared prompts: test_shared_prompt.py)
    parts = Learner.micro_batches(trainer, b)
    assert sorted(torch.cat(parts).tolist()) == list(range(n))
    slots = 0
    for idx in parts:
        mb = b.select(idx).trimmed()
        assert len(idx) <= 8 and (len(idx) == 1 or mb.prompt_ids.numel() + mb.response_ids.numel() <= 120)
        assert mb.prompt_mask.sum() == b.prompt_mask[idx].sum() and mb.response_mask.sum() == b.response_mask[idx].sum()
        slots += mb.prompt_ids.numel() + mb.response_ids.numel()
    unsorted = sum(b.select(idx).trimmed().prompt_ids.numel() + b.select(idx).trimmed().response_ids.numel()
                   for idx in torch.arange(n).split([len(p) for p in parts]))
    assert slots < unsorted


def test_split_to_gives_lockstep_ranks_the_same_number_of_micro_batches():
    """ZeRO-3 over ranks: a rank with fewer micro-batches halves its largest ones (every row still once, in
    order), and a rank with fewer rows than micro-batches adds empty ones (dummy forward passes)."""
    from rlcli.loop.learner import split_to

    assert split_to([[0, 1, 2, 3, 4], [5]], 2) == [[0, 1, 2, 3, 4], [5]]
    assert split_to([[0, 1, 2, 3, 4], [5]], 3) == [[0, 1], [2, 3, 4], [5]]
    assert split_to([[0, 1, 2, 3, 4], [5]], 4) == [[0, 1], [2], [3, 4], [5]]
    assert split_to([[0], [1]], 4) == [[0], [1], [], []]
    assert split_to([], 2) == [[], []]


def test_length_metrics_count_real_tokens_of_the_trained_batch():
    b = batch([0, 1], [(1, 0), (0, 0)], t=4)
    b = b.replace(prompt_mask=torch.tensor([[0, 1], [1, 1], [0, 1], [1, 1]]),  # left-padded: 1, 2, 1, 2 tokens
                  response_mask=torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]))
    counts = {"dynamic_sampling/gen_batches": 1.0, "dynamic_sampling/kept_groups": 2.0,
              "dynamic_sampling/generated_groups": 2.0, "dynamic_sampling/carried": 0.0}
    m = sampling_metrics(b, [b], {}, counts)
    assert m["prompt_length/mean"] == pytest.approx(1.5)  # (1 + 2 + 1 + 2) / 4
    assert m["response_length/mean"] == pytest.approx(2.5) and m["response_length/max"] == 4  # (3 + 1 + 4 + 2) / 4
