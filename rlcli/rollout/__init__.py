"""Rollout: generation engines, reward shaping, and whole-group sampling (dynamic sampling, carry).

Engines are registered in ROLLOUT_ENGINES under their `rollout.engine` name. Each is a class built once
per training process, `Engine(policy_module, tokenizer, policy_path, cfg)`, with two methods:

    generate(prompts, answers, n, sampling: Sampling, group_offset=0, with_logprobs=False) -> RolloutBatch
        whole groups (prompt i owns rows i*n .. i*n+n-1): token ids, masks, `truncated`, and with
        `with_logprobs` the sampler's own log-probs of the sampled tokens (`rollout_logp` [N, T])
    update_weights()
        called after every optimizer step: the engine samples from the new weights from then on

`rest()` (the vLLM engine calls it after each `generate`, MultiTurn after a rollout's last turn: it sleeps with
rollout.sleep_mode), `close()`,
and two attributes: `logprobs_are_free`, whether `rollout_logp` costs nothing extra, so the loop asks for it
every step (the rollout_corr/logp_diff_* and rollout_corr/kl metrics) and not only when algo.rollout_correction
needs it; and `collective`, whether `generate` is a collective over ranks (HF generation under ZeRO-3 over
ranks, a tensor-parallel vLLM engine), so that every rank must call it as often as the others (evaluation
pads its shards for it).

For multi-turn rollout (env.name set) `build_engine` wraps the engine in rlcli.rollout.multiturn.MultiTurn, which keeps
this contract and drives the engine turn by turn through a third method, `continue_tokens(contexts, budgets,
sampling, with_logprobs)`: token ids in, token ids (and log-probs) out.

The loop never knows which engine it has.
"""

from rlcli.core.lazy import exports

__all__ = ["ROLLOUT_ENGINES", "Sampling", "build_engine"]
__getattr__ = exports(__name__, {"ROLLOUT_ENGINES": "engines", "build_engine": "engines", "Sampling": "sampling"})
