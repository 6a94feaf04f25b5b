"""Rollout with Hugging Face `generate` (KV cache): G responses per prompt, produced as whole groups."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlcli.batch import RolloutBatch


def response_mask_from_ids(response_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """Mask up to and including the first EOS; `truncated` where no EOS was generated.

    response_ids [N, T] -> (response_mask [N, T] float, truncated [N] bool)
    """
    is_eos = response_ids == eos_id  # [N, T]
    seen_before = (is_eos.cumsum(-1) - is_eos.long()) > 0  # EOS strictly earlier in the row
    mask = (~seen_before).float()  # [N, T]
    truncated = ~is_eos.any(-1)  # [N]
    return mask, truncated


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
) -> RolloutBatch:
    """Sample `n` responses for each prompt. Rows are grouped: prompt i owns rows i*n .. i*n+n-1.

    temperature == 0 means greedy decoding (evaluation only).
    """
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = enc["input_ids"].repeat_interleave(n, 0)  # [P*G, Tp]
    prompt_mask = enc["attention_mask"].repeat_interleave(n, 0)  # [P*G, Tp]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sample = temperature > 0
    gen_kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
    )
    if sample:
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    was_training = model.training
    model.eval()
    chunks = []
    for s in range(0, prompt_ids.shape[0], batch_size):
        ids = prompt_ids[s : s + batch_size].to(device)
        am = prompt_mask[s : s + batch_size].to(device)
        out = model.generate(input_ids=ids, attention_mask=am, **gen_kwargs)  # [b, Tp + t]
        chunks.append(out[:, ids.shape[1] :].cpu())
    model.train(was_training)
    t = max(c.shape[1] for c in chunks)
    response_ids = torch.cat(
        [torch.nn.functional.pad(c, (0, t - c.shape[1]), value=pad) for c in chunks]
    )  # [N, T]
    response_mask, truncated = response_mask_from_ids(response_ids, eos)
    response_ids = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, pad))
    texts = tokenizer.batch_decode(
        [ids[: int(m.sum())] for ids, m in zip(response_ids, response_mask)], skip_special_tokens=True
    )
    group_index = torch.arange(len(prompts)).repeat_interleave(n) + group_offset  # [N]
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        truncated=truncated,
        group_index=group_index,
        answers=[a for a in answers for _ in range(n)],
        texts=texts,
    )
