"""Rollout with Hugging Face `generate` (KV cache): G responses per prompt, produced as whole groups."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

from rlcli.core.batch import RolloutBatch
from rlcli.engine import generation_weights, lockstep
from rlcli.models import autocast, eval_mode
from rlcli.rollout.sampling import Sampling


def response_mask_from_ids(response_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """Mask up to and including the first EOS; `truncated` where no EOS was generated.

    response_ids [N, T] -> (response_mask [N, T] float, truncated [N] bool)
    """
    is_eos = response_ids == eos_id  # [N, T]
    seen_before = (is_eos.cumsum(-1) - is_eos.long()) > 0  # EOS strictly earlier in the row
    mask = (~seen_before).float()  # [N, T]
    truncated = ~is_eos.any(-1)  # [N]
    return mask, truncated


def sampling_config(max_new_tokens: int, temperature: float, eos: int, pad: int) -> Any:
    """The generation config of a rollout, built from `rollout.*` alone: sampling (temperature 0 = greedy) and
    nothing else that changes the distribution. Temperature, top-k and top-p are `warpers` (below), not fields."""
    from transformers import GenerationConfig

    sample = temperature > 0
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=eos, pad_token_id=pad,
                            use_cache=True, temperature=1.0 if sample else None, top_k=0 if sample else None,
                            top_p=1.0 if sample else None)


def warpers(temperature: float, top_p: float, top_k: int) -> list[Any]:
    """The logits warpers `generate` builds from temperature, top_k and top_p, in its order. Passed as
    `logits_processor` they run after generate's own processors (there are none: sampling_config sets none), so
    a processor appended after them sees the scores that are sampled from."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if temperature <= 0:  # greedy: argmax of the raw scores
        return []
    return [*([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []),
            *([TopKLogitsWarper(top_k=top_k)] if top_k else []),
            *([TopPLogitsWarper(top_p=top_p)] if top_p < 1.0 else [])]


class SampledLogProbs:
    """The last logits processor: the log-probability of each sampled token under the scores it was sampled from,
    holding one step's [b, V] log-softmax at a time. `generate(output_scores=True)` would keep every step's [b, V]
    scores instead: 128 rows x 256 tokens x 151,936 ids took 68 GiB of an H100 where the step needed 17.

    Called before each sampling with the tokens so far; the token sampled from the previous call's scores is the
    last of `input_ids`. `of(new)` closes with the final step's token -> log-probs [b, t] of the new tokens [b, t]."""

    def __init__(self) -> None:
        self.logp: list[Tensor] = []  # [b] per step whose token is known
        self.last: Tensor | None = None  # [b, V] log-softmax of the latest scores

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.last is not None:
            self.logp.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float(), -1)
        return scores

    def of(self, new: Tensor) -> Tensor:
        if self.last is not None:
            self.logp.append(self.last.gather(-1, new[:, -1:]).squeeze(-1))
        return torch.stack(self.logp, 1) if self.logp else new.new_zeros(new.shape, dtype=torch.float32)


@contextmanager
def own_generation_config(model: torch.nn.Module) -> Iterator[None]:
    """Hide the checkpoint's generation_config during `generate`. transformers fills every field a passed
    config leaves unset from `model.generation_config` (a `repetition_penalty` of an instruct model,
    say), which would change the sampled distribution but not the scored one; sampling must equal
    scoring, so the library defaults stand in for the checkpoint's for the duration of the call."""
    from transformers import GenerationConfig

    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft (LoRA) wrapper
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def encode_prompts(tokenizer: Any, prompts: list[str], n: int) -> tuple[Tensor, Tensor]:
    """Each prompt's tokens, left-padded, repeated for its `n` responses: (prompt_ids, prompt_mask) [P*n, Tp]."""
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].repeat_interleave(n, 0), enc["attention_mask"].repeat_interleave(n, 0)


def rollout_batch(tokenizer: Any, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                  rollout_logp: Tensor | None, answers: list[str], n: int, group_offset: int) -> RolloutBatch:
    """What every engine returns, from its generated tokens [N, T] (any padding after the first EOS) and, if
    asked, the sampler's log-probs of them [N, T]: masks up to and including the first EOS, `truncated`,
    padding set to the pad token (log-probs 0), texts decoded by our tokenizer, rows grouped by prompt."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    response_mask, truncated = response_mask_from_ids(response_ids, eos)
    response_ids = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, pad))
    if rollout_logp is not None:
        rollout_logp = rollout_logp.nan_to_num(neginf=0.0) * response_mask  # [N, T], 0 on padding
    texts = tokenizer.batch_decode(
        [ids[: int(m.sum())] for ids, m in zip(response_ids, response_mask)], skip_special_tokens=True
    )
    group_index = torch.arange(len(answers)).repeat_interleave(n) + group_offset  # [N]
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        truncated=truncated,
        group_index=group_index,
        answers=[a for a in answers for _ in range(n)],
        texts=texts,
        rollout_logp=rollout_logp,
        stale=torch.zeros(len(group_index), dtype=torch.bool),
    )


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    answers: list[str],
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 128,
    group_offset: int = 0,
    with_logprobs: bool = False,
    synced_gpus: bool = False,
    prefill_once: bool = False,
) -> RolloutBatch:
    """Sample `n` responses for each prompt. Rows are grouped: prompt i owns rows i*n .. i*n+n-1.

    temperature == 0 means greedy decoding (evaluation only). `with_logprobs` also returns the
    sampler's own log-probs of the sampled tokens (`rollout_logp`, from the processed scores generate
    sampled from, recorded step by step by SampledLogProbs).
    `synced_gpus` (ZeRO-3 over several ranks, where each forward gathers parameters from all ranks): every
    rank keeps stepping until all ranks' batches are done. `prefill_once`: each group's prompt prefilled once
    (shared_prefill).
    """
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, n)  # [P*G, Tp] each
    response_ids, rollout_logp = sample_tokens(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, temperature,
                                               top_p, top_k, batch_size, with_logprobs, synced_gpus, prefill_once)
    return rollout_batch(tokenizer, prompt_ids, prompt_mask, response_ids, rollout_logp, answers, n, group_offset)


def exponential_draws(shape: tuple[int, ...], generator: torch.Generator | None = None, chunk: int = 2**18) -> Tensor:
    """`torch.empty(shape).exponential_(generator=generator)` on a CPU: the same fp32 numbers from the same random
    stream, the generator left in the same state, about 3x faster. torch's CPU kernel draws each number serially as
    -log1p(-u) in double from a uniform double u (53 bits of its Mersenne Twister, in element order) and rounds it to
    fp32 (with torch 2.13's CPU build: its MKL path for exponential_ is compiled out; the tests compare with it); here the uniforms come from `torch.rand` in double (the same stream, in the same order), `chunk` of them at
    a time (their double temporaries stay at 2 MiB each, in cache), and `exponential_of` transforms them on every
    thread. -> [*shape] fp32"""
    q = torch.empty(shape, dtype=torch.float32, device="cpu")
    for part in q.view(-1).split(chunk):
        part.copy_(exponential_of(torch.rand(part.numel(), dtype=torch.float64, device="cpu", generator=generator)))
    return q


def exponential_of(u: Tensor) -> Tensor:
    """fp32 -log1p(-u) of uniform doubles u, rounded as libm's log1p in double then a cast (torch's serial exponential
    kernel) rounds it. torch's vectorized log1p may differ from libm's in the last bit of the double; that changes the
    fp32 result only where the double lies within an ulp or so of a midpoint between two fp32 numbers (about one
    element in 15-30 draws of [64, 49152]): those elements, found with a margin of 4 ulps, are recomputed with libm's
    log1p (Python's math.log1p). -> fp32, u's shape"""
    y = torch.log1p(-u).neg_()  # Exp(1) in double
    q = y.float()
    near = (y * (1 - 2**-50)).float() != y.mul_(1 + 2**-50).float()  # within 4 ulps of a rounding midpoint
    for i in near.flatten().nonzero().squeeze(-1).tolist():
        q.view(-1)[i] = -math.log1p(-u.view(-1)[i].item())
    return q


_FAST = threading.Lock()
_fast_users: list[Any] = []  # torch's own multinomial while a cpu_multinomial block is open, once per open block


@contextmanager
def cpu_multinomial() -> Iterator[None]:
    """Inside the block, `torch.multinomial(p, 1)` on contiguous fp32 CPU probabilities draws through
    `exponential_draws` (HF generate's sampler calls it once per decoding step; at [64, 49152] torch's serial draws
    took 59 of its 62 ms, ~1 s of a 16-token rollout). torch draws one sample as argmax(p / q) with q ~ Exp(1) filled
    in p's memory order (the Gumbel-max trick; aten/src/ATen/native/Distributions.cpp, `multinomial_out`): the same
    division and argmax here, so the same token. Anything else (several samples, other dtypes, devices or layouts, an
    `out`, invalid probabilities, which torch's own checks reject with its own message) goes to torch's function.
    The patch is process-wide while a block is open (nested and concurrent blocks share it; the last to close puts
    torch's function back), so scripting, pickling or compiling torch.multinomial elsewhere meanwhile sees a Python
    function. Two threads sampling at once from the default generator interleave their draws per 2^18 numbers
    instead of per call; torch orders concurrent calls by chance either way."""
    with _FAST:
        original = _fast_users[0] if _fast_users else torch.multinomial
        _fast_users.append(original)
        if len(_fast_users) == 1:
            torch.multinomial = functools.partial(_multinomial, original)
    try:
        yield
    finally:
        with _FAST:
            _fast_users.pop()
            if not _fast_users:
                torch.multinomial = original


def _multinomial(original: Callable[..., Tensor], input: Tensor, num_samples: int, replacement: bool = False, *,
                 generator: torch.Generator | None = None, out: Tensor | None = None) -> Tensor:
    if (num_samples == 1 and out is None and input.device.type == "cpu" and input.dtype == torch.float32
            and input.dim() in (1, 2) and input.is_contiguous() and 0 < input.shape[-1] <= 2**24 and input.numel()
            and bool((input.max() < math.inf) & (input.min() >= 0)) and not bool((input.sum(-1) == 0).any())):
        q = exponential_draws(tuple(input.shape), generator)
        return torch.div(input, q, out=q).argmax(-1, keepdim=True)
    return original(input, num_samples, replacement, generator=generator, out=out)


def sample_tokens(model: torch.nn.Module, tokenizer: Any, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int,
                  temperature: float, top_p: float, top_k: int, batch_size: int, with_logprobs: bool,
                  synced_gpus: bool, prefill_once: bool = False) -> tuple[Tensor, Tensor | None]:
    """`generate` on left-padded prompts [N, Tp], `batch_size` rows at a time. -> (the generated tokens [N, T],
    padded after each row's end with the pad token; with `with_logprobs` the sampler's log-probs of them [N, T])"""
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    config = sampling_config(max_new_tokens, temperature, tokenizer.eos_token_id, pad)
    config.update(return_dict_in_generate=True)  # in the config: transformers deprecates arguments beside one
    chunks, logp_chunks = [], []
    with eval_mode(model), own_generation_config(model), cpu_multinomial() if device.type == "cpu" else nullcontext():
        for s in range(0, prompt_ids.shape[0], batch_size):
            ids = prompt_ids[s : s + batch_size].to(device)
            am = prompt_mask[s : s + batch_size].to(device)
            recorder = SampledLogProbs()
            processors = LogitsProcessorList([*warpers(temperature, top_p, top_k), *([recorder] if with_logprobs else [])])
            # not where every forward is a collective: a rank whose rows repeat no prompt would run one forward fewer
            cache = shared_prefill(model, ids, am) if prefill_once and not synced_gpus else None
            out = model.generate(input_ids=ids, attention_mask=am, generation_config=config, logits_processor=processors,
                                 synced_gpus=synced_gpus, **({"past_key_values": cache} if cache is not None else {}))
            new = out.sequences[:, ids.shape[1] :]  # [b, t]
            chunks.append(new.cpu())
            if with_logprobs:
                logp_chunks.append(recorder.of(new).cpu())  # [b, t]
    t = max(c.shape[1] for c in chunks)
    response_ids = torch.cat(
        [torch.nn.functional.pad(c, (0, t - c.shape[1]), value=pad) for c in chunks]
    )  # [N, T]
    rollout_logp = None
    if with_logprobs:
        rollout_logp = torch.cat([torch.nn.functional.pad(c, (0, t - c.shape[1])) for c in logp_chunks])  # [N, T]
    return response_ids, rollout_logp


def shared_prefill(model: torch.nn.Module, ids: Tensor, mask: Tensor) -> Any:
    """rollout.prefill_once: for left-padded prompts [b, Tp] where runs of equal rows repeat a prompt (a group's G
    responses), the KV cache of each distinct prompt but its last token, computed once and copied to every row of its
    run; `generate` then runs each row's last prompt token as its first step. None when no row repeats its neighbour
    (or prompts of one token), and for a model whose cache is not plain keys and values per layer (sliding windows,
    linear attention or recurrent states, a cache_implementation of its own): those generate as before. Position
    ids as `generate` counts them (real tokens only)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    b, tp = ids.shape
    new_run = torch.ones(b, dtype=torch.bool)
    new_run[1:] = ((ids[1:] != ids[:-1]) | (mask[1:] != mask[:-1])).any(-1)
    if tp < 2 or bool(new_run.all()) or getattr(model.generation_config, "cache_implementation", None):
        return None
    cache = DynamicCache(config=model.config)  # its layers made from the config's layer types (else lazily, plain)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    first = new_run.nonzero().squeeze(-1)  # [u] the first row of each run
    pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # [b, Tp]
    model(input_ids=ids[first, :-1], attention_mask=mask[first, :-1], position_ids=pos[first, :-1],
          past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.batch_select_indices(new_run.long().cumsum(0).to(ids.device) - 1)  # [b] each row's run
    return cache


def left_padded(contexts: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Token lists -> (ids, mask) [N, L], left-padded."""
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts], dtype=torch.long)  # [N, L]
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], dtype=torch.long)  # [N, L]
    return ids, mask


def turn_outputs(tokenizer: Any, response_ids: Tensor, rollout_logp: Tensor | None,
                 budgets: list[int]) -> list[tuple[list[int], list[float] | None]]:
    """Each row's tokens [N, T] up to and including its first EOS and at most its budget, with their log-probs."""
    mask, _ = response_mask_from_ids(response_ids, tokenizer.eos_token_id)
    out = []
    for i, budget in enumerate(budgets):
        n = min(int(mask[i].sum()), budget)
        logp = rollout_logp[i, :n].nan_to_num(neginf=0.0).tolist() if rollout_logp is not None else None
        out.append((response_ids[i, :n].tolist(), logp))
    return out


class HFEngine:
    """`rollout.engine=hf`: transformers `generate` on the training module itself, so it always samples
    from the current weights (nothing to push after an update)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, path: str, cfg: Any):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = cfg.rollout.gen_batch_size
        self.collective = lockstep(cfg.hw)  # ZeRO-3 over ranks: every forward is a collective
        # rollout.zero3_generation, resolved by the memory plan before the run where this engine samples the rollout;
        # left at auto (evaluation beside vLLM or rollout ranks, which the plan does not count) it goes layer by layer
        self.gather = self.collective and cfg.rollout.zero3_generation == "gathered"
        self.gathered: bool | None = None  # whether the last call ran with the whole model gathered (ZeRO-3 only)
        self.prefill_once = cfg.rollout.prefill_once  # a group's prompt prefilled once for its G rows
        self.hw = cfg.hw  # the sampler computes in the trainer's precision (bf16 autocast at ZeRO-0: rlcli.models.autocast)

    # Its sampler log-probs cost a log-softmax over the vocabulary per generated token: only asked for when
    # algo.rollout_correction uses them.
    logprobs_are_free = False

    def generate(self, prompts: list[str], answers: list[str], n: int, sampling: Sampling, group_offset: int = 0,
                 with_logprobs: bool = False) -> RolloutBatch:
        with autocast(self.hw), generation_weights(self.model, self.gather) as gathered:
            self.gathered = gathered if self.collective else None
            return generate(self.model, self.tokenizer, prompts, answers, n, sampling.max_new_tokens, sampling.temperature,
                            sampling.top_p, sampling.top_k, self.batch_size, group_offset, with_logprobs,
                            synced_gpus=self.collective and not gathered, prefill_once=self.prefill_once)

    def continue_tokens(self, contexts: list[list[int]], budgets: list[int], sampling: Sampling,
                        with_logprobs: bool = False) -> list[tuple[list[int], list[float] | None]]:
        """One turn of a multi-turn rollout (rlcli.envs): for each context (token ids), the tokens sampled after
        it up to and including the first EOS, at most its budget, and their sampler log-probs if asked."""
        ids, mask = left_padded(contexts, self.tokenizer.pad_token_id)
        with autocast(self.hw), generation_weights(self.model, self.gather) as gathered:
            self.gathered = gathered if self.collective else None
            response_ids, logp = sample_tokens(self.model, self.tokenizer, ids, mask, max(budgets), sampling.temperature,
                                               sampling.top_p, sampling.top_k, self.batch_size, with_logprobs,
                                               self.collective and not gathered)  # turns: a prefill per row
        return turn_outputs(self.tokenizer, response_ids, logp, budgets)

    def update_weights(self) -> None:
        """Nothing to do: generation reads the training module's parameters."""

    def rest(self) -> None:
        """Nothing to free between generation calls (the vLLM engine sleeps here)."""

    def close(self) -> None:
        """Nothing to release."""

    def weights_checksum(self) -> int:
        """rlcli.engine.checksum of the weights generation reads."""
        from rlcli.engine import checksum

        return checksum(self.model.parameters())
