"""`make bench`'s floor of a step (rlcli/commands/bench.py step_floor): the FLOP- and bandwidth-bound least time of
each stage, against hand-computed numbers."""

import pytest

from rlcli.commands.bench import step_floor

RUN = {"params_m": 100, "ranks": 2, "trajectories": 64, "groups": 8, "gen_batch_size": 16, "precision": "bf16",
       "prompt_length/mean": 10, "response_length/max": 50, "forward_tokens_per_step": 4000, "score_passes": 1,
       "engine": "hf", "prefill_shared": False}


def test_the_floor_counts_flops_at_the_peak_and_decoding_at_the_bandwidth():
    """Psi = 1e8 over 2 ranks: 32 rows per rank in 2 generate calls of 16. At 200 GFLOP/s and 20 GB/s a decoding step
    of 16 rows is compute-bound (2e8 x 16 / 2e11 = 0.016 s > 2e8 B / 2e10 = 0.01 s): rollout = prefill 2e8 x 32 x 10
    / 2e11 = 0.32 s + 2 calls x 50 steps x 0.016 s = 1.92 s; scoring 2e8 x 2000 tokens / 2e11 = 2 s, the update 3x
    that. In fp32 at 5 GB/s the weights' 4e8 B take 0.08 s a step: bandwidth-bound, 0.32 + 100 x 0.08 = 8.32 s."""
    assert step_floor(RUN, 200, 20) == pytest.approx({"rollout": 1.92, "score": 2.0, "update": 6.0})
    assert step_floor({**RUN, "precision": "fp32"}, 200, 5)["rollout"] == pytest.approx(8.32)
    assert step_floor({**RUN, "score_passes": 0}, 200, 20)["score"] == 0


def test_the_floor_prefills_a_shared_prompt_once_and_vllm_decodes_in_one_call():
    """Each group's prompt once (HF's rollout.prefill_once): 4 of this rank's 8 groups' prompts, 2e8 x 4 x 10 / 2e11
    = 0.04 s of prefill, + the same 1.6 s of decoding. vLLM (its prefix cache shares the prompt too) decodes this
    rank's 32 rows in one call: 50 steps of max(0.01, 2e8 x 32 / 2e11 = 0.032) s = 1.6 s, + 0.04 s."""
    assert step_floor({**RUN, "prefill_shared": True}, 200, 20)["rollout"] == pytest.approx(0.04 + 1.6)
    assert step_floor({**RUN, "engine": "vllm", "prefill_shared": True}, 200, 20)["rollout"] == pytest.approx(1.64)
    assert step_floor({**RUN, "engine": "vllm", "gen_batch_size": 4}, 200, 20)["rollout"] == pytest.approx(0.32 + 1.6)


def test_stage_rates_count_the_positions_each_stage_computes():
    """Psi = 1e8, 64 rows of 8 groups, prompts of 40 and responses of 5 tokens. Generation computes 64 x 45 = 2880
    positions with a prefill per row; 8 x 40 + 56 x 1 + 64 x 5 = 696 with HF's shared prefill (each further row runs
    its prompt's last token); 8 x 40 + 56 x 8 + 320 = 1088 with vLLM's 32-token blocks (40 - 32 = 8 of each further
    row's prompt); at 128-token blocks nothing is shared, 2880. 2 x 1e8 x 696 = 139.2 GFLOP in 0.696 s: 200 GFLOP/s,
    100 % of 200; one scoring pass of 4000 forward tokens in 8 s is 100 GFLOP/s, the update 6Psi x 4000 in 12 s 200."""
    from rlcli.commands.bench import rollout_positions, stage_rates

    r = {**RUN, "trajectories": 64, "groups": 8, "prompt_length/mean": 40, "response_length/mean": 5,
         "prefill_shared": True, "kv_block": 1}
    assert rollout_positions({**r, "prefill_shared": False}) == 2880 and rollout_positions(r) == 696
    assert rollout_positions({**r, "kv_block": 32}) == 1088 and rollout_positions({**r, "kv_block": 128}) == 2880
    timed = {**r, "timing_s/rollout": 0.696, "timing_s/score": 8, "timing_s/update": 12, "shared": True}
    rows = {line.split()[0]: line.split()[-2:] for line in stage_rates({"hf": timed}, 200).splitlines()[1:4]}
    assert rows == {"rollout": ["200", "(100%)"], "score": ["100", "(50%)"], "update": ["200", "(100%)"]}


def test_repeat_update_runs_the_next_update_again_over_its_batch_and_then_lets_go():
    """`bench --update`: the learner's next update runs once as the step asked, then `reps` more times over the same
    arguments, each timed; the update after it is the learner's own again."""
    from rlcli.commands.bench import repeat_update

    class Learner:
        def __init__(self):
            self.batches = []

        def update(self, batch, phase):
            self.batches.append((batch, phase))
            return len(self.batches)

    learner = Learner()
    own = learner.update
    times = repeat_update(learner, 3)
    assert learner.update("b1", "rl") == 1  # the step's own result
    assert learner.batches == [("b1", "rl")] * 4 and len(times) == 3 and all(t >= 0 for t in times)
    assert learner.update == own and learner.update("b2", "rl") == 5 and len(times) == 3
