"""The reward model: a causal LM with a scalar head read at the last non-padding token, and `score`.

Any causal LM the policy can be (the embedded tiny Llama, model=smollm2-135m, a local Hugging Face directory) loads
as `AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)`: transformers builds the model family's
`*ForSequenceClassification` (the backbone without the LM head, plus a bias-free linear `score` head, new unless the
directory is already a reward model) and pools its output at the rightmost token that is not `config.pad_token_id`
(transformers' GenericForSequenceClassification), which finds the end of a left- or a right-padded sequence alike.

rlcli scores with that forward and that pooling, never its own, so the directory `rlcli rm` saves gives the same
scores in any program that runs

    model = AutoModelForSequenceClassification.from_pretrained(run_dir + "/reward_model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir + "/reward_model")  # the tiny model: PreTrainedTokenizerFast
    enc = tokenizer([prompt + response], add_special_tokens=False, return_tensors="pt")
    reward = model(**enc).logits[:, 0]

The encoding is the text `prompt + response` (a chat-formatted pair: the rendered prompt, generation prompt
included, then the rendered assistant turn), tokenized without added special tokens, right-padded. A tokenizer whose
pad token is its EOS token (load_tokenizer sets that when it has none) makes a trailing EOS a pad token for the
pooling: the score is then read at the token before it, consistently for every padding.

Letters as in docs/design.md#units: n sequences, L the padded length.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from rlcli.models.policy import DTYPES, eval_mode, load_tokenizer, with_lora

log = logging.getLogger(__name__)

HEAD = "score"
"""The scalar head's module name in transformers' *ForSequenceClassification models."""


def load_reward_model(model_cfg: Any, path: str, seed: int = 0) -> tuple[torch.nn.Module, Any, bool]:
    """(`path` as a scalar-head sequence classifier, its tokenizer, whether the head is new). The new head is
    initialised by transformers (normal, std config.initializer_range) from torch's RNG seeded with `seed`, on a
    forked RNG (the caller's stream does not move). config.pad_token_id is the tokenizer's pad token, which the
    pooling needs. LoRA (model.lora.r > 0) wraps it with peft's SEQ_CLS task, which keeps the head trainable."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    tokenizer = load_tokenizer(model_cfg.tokenizer_path or path, model_cfg.trust_remote_code)
    kwargs: dict[str, Any] = dict(dtype=DTYPES[model_cfg.dtype], trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.attn_implementation:
        kwargs["attn_implementation"] = model_cfg.attn_implementation
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the new head as MISSING: expected, checked below
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, info = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, pad_token_id=tokenizer.pad_token_id, output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(info["missing_keys"])
    new_head = any(k.split(".")[0] == HEAD for k in missing)
    others = [k for k in missing if k.split(".")[0] != HEAD]
    if others:
        raise ValueError(f"{path} lacks weights of the reward model's backbone ({', '.join(others[:5])}"
                         f"{' ...' if len(others) > 5 else ''}): point model.path at a causal LM or a reward model")
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if model_cfg.lora.r:
        model = with_lora(model, model_cfg.lora, task_type="SEQ_CLS")
    return model, tokenizer, new_head


def encode(tokenizer: Any, prompts: list[str], responses: list[str]) -> dict[str, Tensor]:
    """`prompt + response` texts as right-padded input_ids and attention_mask [n, L] (no special tokens added)."""
    return tokenizer([p + r for p, r in zip(prompts, responses)], add_special_tokens=False, padding=True,
                     padding_side="right", return_tensors="pt")


def rewards(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The model's own scalar at the last non-padding token of each row: [n, L] -> [n] in fp32 (in the graph)."""
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
    return out.logits[:, 0].float()  # [n]: logits is [n, num_labels=1], pooled by the model


@torch.no_grad()
def score(model: torch.nn.Module, tokenizer: Any, prompts: list[str], responses: list[str],
          batch_size: int = 32) -> Tensor:
    """Rewards of (prompt, response) texts: [N] fp32 on the CPU. Eval mode (no dropout) and no gradient, `batch_size`
    sequences per forward (memory only: padding never changes a score). The one scoring function of rlcli: held-out
    pair accuracy uses it, and so does anything that scores responses with a trained reward model."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    out = []
    with eval_mode(model):
        for i in range(0, len(prompts), batch_size):
            enc = encode(tokenizer, prompts[i : i + batch_size], responses[i : i + batch_size])
            out.append(rewards(model, enc["input_ids"], enc["attention_mask"]).cpu())
    return torch.cat(out) if out else torch.zeros(0)
