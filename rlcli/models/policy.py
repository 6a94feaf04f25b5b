"""Loading policies and tokenizers, and the one forward pass that turns a batch into log-probs (re-exported by rlcli.models)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

from rlcli.core.layout import forward_shape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(hw: Any) -> Any:
    """The context every forward pass of the trained models runs in (scoring, the update, HF generation): bf16
    autocast under `rlcli.core.precision.mixed_precision(hw)`, else a no-op. Backward passes follow the forward's dtypes by
    themselves; log-softmax, losses and reductions stay fp32 (rlcli casts logits to fp32 before them)."""
    from rlcli.core.precision import mixed_precision

    enabled = mixed_precision(hw)
    if enabled and hw.device == "cpu":
        fp32_attention_on_cpu()
    return torch.autocast(hw.device, dtype=torch.bfloat16, enabled=enabled)


FP32_ATTENTION_MAX = 512
"""The most key positions whose attention fp32_attention_on_cpu computes in fp32 (beyond, bf16 as autocast casts)."""


@functools.cache
def fp32_attention_on_cpu() -> None:
    """Route transformers' `sdpa` attention through fp32 on a CPU without AMX under autocast (once per process). There
    q and k arrive in fp32 (RoPE's fp32 cos and sin promote them) and autocast would cast q, k and v to bf16 at every
    call (at each decoding step the whole KV cache); on such a CPU (AVX512-BF16 without AMX) torch's fp32 attention
    kernels are as fast as its bf16 ones or faster up to FP32_ATTENTION_MAX key positions, forward and backward (2
    cores, docs/results.md). A decoding step (one query position) takes decode_attention. The fp32 output goes to
    o_proj, which autocast casts to bf16. Elsewhere (a GPU, no autocast, longer keys, sequence parallelism) `sdpa`
    runs as it was. Ulysses (rlcli.engine.sequence) wraps it or is wrapped by it: each wrapper carries the marks of
    the ones it wraps (functools.wraps copies them), so neither wraps twice."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rlcli.core.precision import native_bf16
    from rlcli.engine.sequence import sharding_active

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(original, "rlcli_fp32", False) or native_bf16("cpu") == "AMX-BF16":
        return

    @functools.wraps(original)  # carries the marks of the wrappers below it (Ulysses')
    def attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Any, *args: Any,
                  **kwargs: Any) -> Any:
        if (query.device.type != "cpu" or not torch.is_autocast_enabled("cpu") or key.shape[2] > FP32_ATTENTION_MAX
                or sharding_active()):  # Ulysses: this rank's slice of the positions, before its all-to-all
            return original(module, query, key, value, mask, *args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            query, key, value = query.float(), key.float(), value.float()
            if query.shape[2] == 1 and not args and kwargs.get("dropout", 0.0) == 0.0 and kwargs.get(
                    "position_bias") is None and kwargs.get("cache") is None and (mask is None or mask.dtype == torch.bool):
                return decode_attention(query, key, value, mask, kwargs.get("scaling"))
            return original(module, query, key, value, mask, *args, **kwargs)

    attention.rlcli_fp32 = True  # type: ignore[attr-defined]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float | None
                     ) -> tuple[Tensor, None]:
    """One decoding step's attention as `sdpa` computes it (fp32, no dropout): queries [b, h, 1, d] of h = g·kv heads
    against the KV cache [b, kv, L, d] and a boolean mask [b or 1, 1, 1, L] (True: attend) or None, each group of g query
    heads reading its key-value head in place (no repeated copy of the cache), in two batched matmuls instead of a
    flash-kernel call (whose fixed cost per call is most of a decoding step's attention at these lengths,
    docs/results.md). -> (the output [b, 1, h, d], None) like transformers' sdpa_attention_forward."""
    b, h, _, d = query.shape
    kv = key.shape[1]
    scores = torch.matmul(query.view(b, kv, h // kv, d), key.transpose(-1, -2))  # [b, kv, g, L]
    scores = scores.mul_(d**-0.5 if scaling is None else scaling)
    if mask is not None:
        scores = scores.masked_fill_(~mask.view(mask.shape[0], 1, 1, mask.shape[-1]), float("-inf"))
    out = torch.matmul(torch.softmax(scores, -1), value)  # [b, kv, g, d]
    return out.reshape(b, 1, h, value.shape[-1]), None  # values may be wider than queries and keys (MLA)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """A folder whose tokenizer_config names PreTrainedTokenizerFast (our tiny tokenizer) is loaded
    with that class directly: AutoTokenizer may substitute a model-family tokenizer
    (docs/design.md#environment)."""
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg_file):
        with open(cfg_file) as f:
            if json.load(f).get("tokenizer_class") == "PreTrainedTokenizerFast":
                return PreTrainedTokenizerFast.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(model_cfg: Any, path: str) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = dict(
        dtype=DTYPES[model_cfg.dtype], trust_remote_code=model_cfg.trust_remote_code
    )
    if model_cfg.attn_implementation:
        kwargs["attn_implementation"] = model_cfg.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if model_cfg.lora.r:
        model = with_lora(model, model_cfg.lora)
    tokenizer = load_tokenizer(model_cfg.tokenizer_path or path, model_cfg.trust_remote_code)
    return model, tokenizer


def with_lora(model: torch.nn.Module, lora: Any, task_type: str = "CAUSAL_LM") -> torch.nn.Module:
    """`model` wrapped by peft with LoRA adapters on `lora.target_modules`; the base weights are frozen. peft's
    `task_type` SEQ_CLS (a reward model) also trains the classifier head (peft's modules_to_save)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ImportError("model.lora.r > 0 needs peft: pip install 'rlcli[lora]'") from e
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type=task_type)
    return get_peft_model(model, config)


def joint_inputs(
    prompt_ids: Tensor,  # [n, Tp] left-padded
    prompt_mask: Tensor,  # [n, Tp]
    response_ids: Tensor,  # [n, T] right-padded
    token_mask: Tensor,  # [n, T] 1 on every real response token (RolloutBatch.token_mask)
    device: torch.device,
) -> dict[str, Tensor]:
    """Model inputs for prompt + response, as policy and critic both read them: position ids count
    only real tokens, so a left-padded prompt sees the positions it had during generation. A multi-turn
    row's observation tokens are real tokens here: the model read them when it generated the next turn.
    Outputs at [:, Tp-1 : -1] belong to the state before each response token."""
    input_ids = torch.cat([prompt_ids, response_ids], 1).to(device)  # [n, Tp+T]
    attn = torch.cat([prompt_mask, token_mask.to(prompt_mask.dtype)], 1).to(device)  # [n, Tp+T]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, Tp+T]
    return {"input_ids": input_ids, "attention_mask": attn, "position_ids": position_ids}


SHARING_ATTENTION = ("sdpa", "eager")
"""The attention implementations that take a custom [k, 1, L, L] mask as it is (transformers' masking_utils returns a
4D mask unchanged): the ones a shared-prompt forward runs on. flash_attention_2 and flex_attention do not."""


def attention_of(model: torch.nn.Module) -> str | None:
    """The attention implementation `model` runs (its transformers config's), None if it has no config."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def sharing(model: torch.nn.Module, share: bool) -> str | None:
    """`model`'s attention implementation if `share` and it takes a shared-prompt forward's mask
    (SHARING_ATTENTION), else None: the `attention` argument of `joint`. The learner passes the `share` that
    `prompt_sharing_for` checked at start-up."""
    attention = attention_of(model)
    return attention if share and attention in SHARING_ATTENTION else None


def prompt_runs(prompt_ids: Tensor, prompt_mask: Tensor) -> list[int]:
    """Lengths of the runs of consecutive rows with the same prompt (ids and mask, padding included): the rows a
    shared-prompt forward gives one copy of their prompt. [n, Tp] -> k run lengths summing to n."""
    n = prompt_ids.shape[0]
    if n == 0:
        return []
    same = ((prompt_ids[1:] == prompt_ids[:-1]) & (prompt_mask[1:] == prompt_mask[:-1])).all(-1)  # [n-1]
    starts = [0, *(torch.nonzero(~same).squeeze(-1) + 1).tolist(), n]
    return [b - a for a, b in zip(starts, starts[1:])]


@dataclass(frozen=True)
class Joint:
    """The model inputs of a micro-batch and where the output before each response token sits in them.

    Separate rows (`runs` None): [n, Tp+T] sequences, prompt then response, as `joint_inputs` builds them.
    Shared prompts: k sequences [k, L], L = Tp + g·T for runs of at most g rows with one prompt: the prompt once,
    then each row's response in its own segment of T columns. The [k, 1, L, L] attention mask lets a response token
    see the prompt's real tokens and the real tokens of its own segment up to itself, nothing else (every position
    sees itself, so no attention row is empty); position ids are the separate rows' (a segment continues from the
    prompt's length), so each response token's output is the one its own row would give, up to rounding, and the
    prompt's gradient is the sum over its rows (autograd adds the segments' contributions)."""

    inputs: dict[str, Tensor]  # input_ids, position_ids [k, L]; attention_mask [k, L] or [k, 1, L, L]
    at: Tensor  # [n, T] index into the flattened [k·L] outputs of the state before each response token
    tp: int
    runs: list[int] | None = None

    def pick(self, out: Tensor) -> Tensor:
        """Outputs [k, L, ...] -> [n, T, ...] at the states before the response tokens."""
        if self.runs is None:
            return out[:, self.tp - 1 : -1]
        return out.flatten(0, 1)[self.at.flatten()].unflatten(0, tuple(self.at.shape))


def joint(
    prompt_ids: Tensor,  # [n, Tp] left-padded
    prompt_mask: Tensor,  # [n, Tp]
    response_ids: Tensor,  # [n, T] right-padded
    token_mask: Tensor,  # [n, T]
    device: torch.device,
    attention: str | None = None,
) -> Joint:
    """The `Joint` layout of a micro-batch: runs of rows with one prompt share it when `attention` (the model's
    attention implementation) is one of SHARING_ATTENTION and that runs fewer positions
    (rlcli.core.layout.forward_shape), else one sequence per row."""
    n, tp = prompt_ids.shape
    t = response_ids.shape[1]
    runs = prompt_runs(prompt_ids, prompt_mask) if attention in SHARING_ATTENTION else None
    k, width = forward_shape(runs, tp, t, True) if runs else (n, tp + t)  # width: L
    if k == n:  # nothing to share, or sharing would run more positions (runs of very different sizes)
        return Joint(joint_inputs(prompt_ids, prompt_mask, response_ids, token_mask, device), torch.empty(0), tp)
    g = max(runs)
    sizes = torch.tensor(runs)
    first = sizes.cumsum(0) - sizes  # [k] first row of each run
    run_of = torch.repeat_interleave(torch.arange(k), sizes)  # [n]
    segment = torch.arange(n) - first[run_of]  # [n] the row's place in its run
    cols = tp + segment[:, None] * t + torch.arange(t)  # [n, T] its response's columns
    ids = torch.zeros(k, width, dtype=prompt_ids.dtype)
    real = torch.zeros(k, width, dtype=torch.bool)
    pos = torch.zeros(k, width, dtype=torch.long)
    ids[:, :tp], real[:, :tp] = prompt_ids[first], prompt_mask[first].bool()
    pos[:, :tp] = (prompt_mask[first].long().cumsum(-1) - 1).clamp(min=0)
    rows = run_of[:, None].expand(n, t)
    ids[rows, cols], real[rows, cols] = response_ids, token_mask.bool()
    pos[rows, cols] = (prompt_mask[first].long().sum(-1)[run_of, None] + token_mask.long().cumsum(-1) - 1).clamp(min=0)
    seg_of_col = torch.cat([torch.full((tp,), -1), torch.arange(g).repeat_interleave(t)])  # [L]; -1: the prompt
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [L query, L key]
    visible = causal & ((seg_of_col[None, :] == -1) | (seg_of_col[None, :] == seg_of_col[:, None]))  # [L, L]
    allowed = (real[:, None, :] & visible) | torch.eye(width, dtype=torch.bool)  # [k, L, L]
    if attention == "eager":  # an additive mask: eager attention adds it to the scores
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    else:  # sdpa: True where a query attends
        mask = allowed
    at = run_of[:, None] * width + torch.where(torch.arange(t) == 0, tp - 1, cols - 1)  # [n, T]
    inputs = {"input_ids": ids.to(device), "attention_mask": mask[:, None].to(device), "position_ids": pos.to(device)}
    return Joint(inputs, at.to(device), tp, runs)


@dataclass(frozen=True)
class Slices:
    """A micro-batch laid out for sequence parallelism (hw.sp_size = N; rlcli.engine.sequence): this rank's slice of
    the positions of every row.

    Each row's real tokens (prompt, then response, observations included) are moved to positions 0.. without padding
    in between, and the rows are right-padded to a common length L, a multiple of N; rank r holds positions
    [r·L/N, (r+1)·L/N). Causal attention over the whole positions is then the whole mask (padding only follows a
    row's tokens), which is what the Ulysses attention computes; position ids are the positions, as `joint_inputs`
    counts them. The forward of a slice scores every position of it; `pick` gathers those per-position outputs from
    the group and takes the state before each response token."""

    inputs: dict[str, Tensor]  # input_ids, position_ids [n, L/N] this rank's slice; attention_mask None
    targets: Tensor  # [n, L/N] the token after each position of the slice
    at: Tensor  # [n, T] the position of the state before each response token, in [0, L)
    sp: Any  # the group: gather()

    def pick(self, out: Tensor) -> Tensor:
        """Outputs [n, L/N, ...] of this slice -> [n, T, ...] at the states before the response tokens."""
        whole = self.sp.gather(out)  # [n, L, ...]
        at = self.at.reshape(*self.at.shape, *[1] * (whole.dim() - 2)).expand(*self.at.shape, *whole.shape[2:])
        return whole.gather(1, at)


def slices(
    prompt_ids: Tensor,  # [n, Tp] left-padded
    prompt_mask: Tensor,  # [n, Tp]
    response_ids: Tensor,  # [n, T] right-padded
    token_mask: Tensor,  # [n, T]
    device: torch.device,
    sp: Any,  # rlcli.engine.sequence.SequenceParallel: size, rank, gather
) -> Slices:
    """The `Slices` layout of a micro-batch on this rank."""
    ids = torch.cat([prompt_ids, response_ids], 1)  # [n, Tp+T]
    real = torch.cat([prompt_mask, token_mask.to(prompt_mask.dtype)], 1).bool()  # [n, Tp+T]
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # [n, Tp+T] the position of each token
    n, tp = prompt_ids.shape
    width = -(-max(int(real.sum(-1).max()) if n else 1, 1) // sp.size) * sp.size  # L
    packed = torch.zeros(n, width, dtype=ids.dtype)  # [n, L] the rows' real tokens from position 0, then 0s
    packed[torch.arange(n)[:, None].expand_as(ids)[real], pos[real]] = ids[real]
    targets = torch.cat([packed[:, 1:], packed[:, :1]], 1)  # [n, L]; the last position predicts nothing used
    part = width // sp.size
    lo = sp.rank * part
    inputs = {"input_ids": packed[:, lo : lo + part].to(device), "attention_mask": None,
              "position_ids": torch.arange(lo, lo + part).expand(n, part).to(device)}
    at = (pos[:, tp:] - 1).clamp(min=0)  # [n, T] the state before response token j sits at its position - 1
    return Slices(inputs, targets[:, lo : lo + part].to(device), at.to(device), sp)


def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: Tensor,  # [n, Tp]
    prompt_mask: Tensor,  # [n, Tp]
    response_ids: Tensor,  # [n, T]
    token_mask: Tensor,  # [n, T] RolloutBatch.token_mask
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk: int = 0,
    share: bool = False,
    sp: Any = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of the response tokens under `model`, logits divided by the sampling temperature.

    Returns (logp [n, T], entropy [n, T] or None). Position ids count only real tokens, so a
    left-padded prompt sees the same positions as it did during generation. The entropy is a
    metric unless `entropy_grad` (an entropy bonus): then it stays in the autograd graph.

    With `chunk` > 0 the vocabulary projection runs over `chunk` response positions at a time and only
    for response positions, and under autograd each chunk's logits are recomputed in backward instead of
    kept: the fp32 logits alive at once are [n, chunk, V], never [n, Tp+T, V]. That is exact only for a
    model whose logits are its output projection of the last hidden state: pass the chunk that
    `logits_chunk_for` returned, which is 0 for other models.

    With `share`, rows next to each other with the same prompt (a group's G responses) share one forward of it
    (`Joint`, where the model's attention implementation takes its mask): the same outputs up to rounding.

    With `sp` (a sequence-parallel group, inside its `sharding()`), each rank runs its slice of every row's positions
    (`Slices`) and the per-position outputs are gathered: the same outputs up to rounding, on every rank of the group.
    """
    logp, entropy, _ = response_outputs(model, prompt_ids, prompt_mask, response_ids, token_mask, temperature,
                                        with_entropy, entropy_grad, chunk, share=share, sp=sp)
    return logp, entropy


def response_outputs(
    model: torch.nn.Module,
    prompt_ids: Tensor,  # [n, Tp]
    prompt_mask: Tensor,  # [n, Tp]
    response_ids: Tensor,  # [n, T]
    token_mask: Tensor,  # [n, T]
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk: int = 0,
    kl_to: Tensor | None = None,  # [n, T, V] another policy's log-softmax at the same temperature, no grad
    share: bool = False,
    sp: Any = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`response_logprobs`' one pass, and with `kl_to` also the exact reverse KL to that policy at every response
    position, KL(π ‖ π_other)_t = Σ_v π(v) (log π(v) − log π_other(v)) over the whole vocabulary, in the graph
    (on-policy distillation's full-vocabulary term, distill.full_kl_coef). -> (logp, entropy or None, kl or None),
    [n, T] each."""
    device = next(model.parameters()).device
    if sp is None:  # the states before the response tokens are scored
        layout: Joint | Slices = joint(prompt_ids, prompt_mask, response_ids, token_mask, device, sharing(model, share))
        before, after, targets = layout.pick, _same, response_ids.to(device)  # [n, T]
    else:  # every position of this rank's slice is scored, then the response tokens' are picked from the group's
        if kl_to is not None:
            raise ValueError("the full-vocabulary KL is not computed under sequence parallelism (hw.sp_size > 1)")
        layout = slices(prompt_ids, prompt_mask, response_ids, token_mask, device, sp)
        before, after, targets = _same, layout.pick, layout.targets  # [n, L/N]
    if not chunk:
        logits = before(model(**layout.inputs, use_cache=False).logits)  # [n, t, V] predicts `targets`
        return _picked(after, _token_outputs(logits, targets, temperature, with_entropy, entropy_grad, kl_to))
    hidden = before(model.get_decoder()(**layout.inputs, use_cache=False).last_hidden_state)  # [n, t, H]
    head = model.get_output_embeddings()

    def part(h: Tensor, y: Tensor, other: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:  # [n, c, H], [n, c] -> [n, c]
        logp, entropy, kl = _token_outputs(head(h), y, temperature, with_entropy, entropy_grad, other)
        return (logp, torch.zeros_like(logp) if entropy is None else entropy,
                torch.zeros_like(logp) if kl is None else kl)

    others = kl_to.to(device).split(chunk, 1) if kl_to is not None else [None] * len(targets.split(chunk, 1))
    # Each chunk's head, upcast and log-softmax are recomputed in the backward pass, so that only one chunk's [n, c, V]
    # tensors live at a time; with one chunk they are alive at the backward's start either way (the same peak), so
    # they are kept instead of computed twice.
    recompute = torch.is_grad_enabled() and len(others) > 1
    parts = [
        torch.utils.checkpoint.checkpoint(part, h, y, o, use_reentrant=False) if recompute else part(h, y, o)
        for h, y, o in zip(hidden.split(chunk, 1), targets.split(chunk, 1), others)
    ]
    logp = torch.cat([p[0] for p in parts], 1)  # [n, t]
    return _picked(after, (logp, torch.cat([p[1] for p in parts], 1) if with_entropy else None,
                           torch.cat([p[2] for p in parts], 1) if kl_to is not None else None))


def _same(x: Tensor) -> Tensor:
    return x


def _picked(pick: Callable[[Tensor], Tensor], outs: tuple[Tensor | None, ...]) -> Any:
    return tuple(None if o is None else pick(o) for o in outs)


def response_log_softmax(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                         token_mask: Tensor, temperature: float, share: bool = False) -> Tensor:
    """The whole next-token distribution at every response position, log_softmax(logits / temperature) in fp32,
    without grad: the `kl_to` of `response_outputs` (a distillation teacher's). -> [n, T, V]"""
    device = next(model.parameters()).device
    layout = joint(prompt_ids, prompt_mask, response_ids, token_mask, device, sharing(model, share))
    with torch.no_grad():
        logits = layout.pick(model(**layout.inputs, use_cache=False).logits)  # [n, T, V]
        return torch.log_softmax(scaled(logits, temperature), -1)


def scaled(logits: Tensor, temperature: float) -> Tensor:
    """`logits` in fp32 divided by the sampling temperature; at temperature 1 the division is skipped (x / 1 is x in
    IEEE arithmetic; over a 49k vocabulary the pass and its backward cost 46 ms each on 2 CPU cores)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def _token_outputs(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool,
    kl_to: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """[n, t, V] logits, [n, t] targets -> (log-probs of the targets [n, t], entropy [n, t] or None, the reverse KL
    to `kl_to` [n, t] or None), in fp32 from logits divided by the temperature."""
    from rlcli.algos.functional import entropy_from_log_probs, reverse_kl_full

    logits = scaled(logits, temperature)
    log_probs = torch.log_softmax(logits, -1)  # [n, t, V]
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_log_probs(log_probs if entropy_grad else log_probs.detach()) if with_entropy else None
    return logp, entropy, reverse_kl_full(logits, kl_to) if kl_to is not None else None


@contextmanager
def eval_mode(*modules: torch.nn.Module) -> Iterator[None]:
    """`modules` in eval mode (no dropout) for the block, then back in the mode each was in."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


def rounding_tolerance(model: torch.nn.Module) -> float:
    """Nats two exact ways of computing `model`'s log-probs may differ by in a start-up check: 1e-4 in fp32, 5e-2
    under bf16 weights or autocast."""
    p = next(model.parameters())
    return 1e-4 if p.dtype == torch.float32 and not torch.is_autocast_enabled(p.device.type) else 5e-2


def prompt_sharing_for(model: torch.nn.Module, share: bool) -> tuple[bool, str]:
    """(whether scoring and the update give each group's prompt one forward (`Joint`), a note saying which). Checked
    once, at start-up, on a short random batch in eval mode, one prompt with three responses of which one is
    padded: the shared forward must give the log-probs of a forward per row. An attention implementation that takes
    no custom mask (flash_attention_2, flex_attention), or a model whose own code ignores or rejects the 4D mask
    (remote code, a model building its own causal mask), fails it and runs a forward per row. Under ZeRO-3 every
    rank runs it at the same point (each forward is a collective).

    Under bf16 autocast over fp32 weights the two layouts may take different attention kernels (sdpa: the causal
    one per row, the masked one shared), whose roundings, with the bf16 matmuls around them, differ by up to an ulp
    of the bf16 logits (SmolLM2 with bf16 attention: 0.15 nats at logits of 34, where an ulp is 0.25). Both are then
    measured against the same forward in fp32: the shared one passes when it is within twice the per-row forward's
    own distance from it (SmolLM2: 0.146 against 0.102), while a block mask that lets segments see each other misses
    by nats (2.0 on the same check)."""
    attention = attention_of(model)
    if not share:
        return False, "a forward per row (hw.share_prompts=false)"
    if attention not in SHARING_ATTENTION:
        return False, f"a forward per row: {attention} attention takes no custom mask"
    g = torch.Generator().manual_seed(0)
    low = min(model.config.vocab_size, 1000)  # not the embedding's shape: a placeholder of size 0 under ZeRO-3
    prompt = torch.randint(low, (1, 6), generator=g).repeat(3, 1)  # [3, 6]: one prompt, three rows
    response = torch.randint(low, (3, 5), generator=g)  # [3, 5]
    mask = torch.ones_like(response)
    mask[1, 3:] = 0  # a shorter response: padding the others must not see
    args = (model, prompt, torch.ones_like(prompt), response, mask, 1.0)
    device = next(model.parameters()).device
    with torch.no_grad(), eval_mode(model):
        rows, _ = response_logprobs(*args)  # [3, 5]
        try:
            shared, _ = response_logprobs(*args, share=True)  # [3, 5]
        except (RuntimeError, ValueError, TypeError) as e:
            return False, f"a forward per row: the model's forward refused the shared layout ({type(e).__name__}: {e})"
        exact = rows
        if torch.is_autocast_enabled(device.type):  # the rows' own rounding, against the same weights in fp32
            with torch.autocast(device.type, enabled=False):
                exact, _ = response_logprobs(*args)

    def off(x: Tensor) -> float:
        return float(((x - exact).abs() * mask.to(device)).max())

    err, own = off(shared), off(rows)
    if err > max(rounding_tolerance(model), 2 * own):
        return False, (f"a forward per row: a shared forward differs from the model's own by {err:.3g} nats (its "
                       "attention does not follow the block mask)" + (
                           f"; a forward per row is {own:.3g} nats from fp32" if own else ""))
    rounding = f", a forward per row {own:.1e} from fp32" if own else ""
    return True, (f"each group's prompt once per micro-batch ({attention} attention, a block mask; checked: max diff "
                  f"{err:.1e}{rounding})")


def logits_chunk_for(model: torch.nn.Module, chunk: int) -> tuple[int, str]:
    """(`chunk` if the chunked log-prob pass reproduces `model`'s own logits path, else 0; a note saying
    which). Checked once, at start-up, on a short random sequence in eval mode: models that change their
    logits after the output projection (soft-capping, Granite's logits_scaling, Falcon-H1's
    lm_head_multiplier, MiniCPM3's scaling ...) fail it and take the whole-sequence pass. Under ZeRO-3 every
    rank runs it at the same point (each forward is a collective)."""
    if not chunk:
        return 0, "whole sequence (hw.logits_chunk=0)"
    try:
        structural = model.get_decoder() is not None and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        structural = False
    if not structural:
        return 0, "whole sequence: the model exposes no decoder/output embedding to chunk"
    vocab = model.config.vocab_size  # not the head's shape: under ZeRO-3 that is a placeholder of size 0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(vocab, 1000), (2, 16), generator=g)  # [2, 16]: 6 prompt + 10 response tokens
    ones = torch.ones_like(ids)
    with torch.no_grad(), eval_mode(model):
        args = (model, ids[:, :6], ones[:, :6], ids[:, 6:], ones[:, 6:], 1.0)
        whole, _ = response_logprobs(*args, chunk=0)  # [2, 10]
        parts, _ = response_logprobs(*args, chunk=3)  # [2, 10] in four chunks
    err = float((whole - parts).abs().max())
    if err > rounding_tolerance(model):
        return 0, (f"whole sequence: chunked log-probs differ from the model's own logits by {err:.3g} nats "
                   "(it changes its logits after the output projection)")
    return chunk, f"{chunk} positions per chunk (checked against the model's own logits: max diff {err:.1e})"
