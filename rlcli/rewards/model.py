"""The `rm` part of the task reward (reward=rm, docs/reward_models.md#rewardrm): a trained reward model scores each
(prompt, response) of a rollout batch, in the process that holds the batch, with rlcli.models.reward.score.

Text, not tokens. `rlcli rm` trained on the text `prompt + response`, tokenized by the reward model's tokenizer
without added special tokens (rlcli.models.reward.encode, rlcli.rm.pairs), so the loop rebuilds that text:
  prompt    the policy's prompt tokens decoded as they are, padding dropped: special tokens kept, since a chat
            template's turn markers are part of the rendered prompt a pair holds
  response  the text the verifiers read (special tokens dropped, so no EOS: a pair's response has none), and in
            chat mode (data.chat, resolved for the policy's tokenizer) followed by the template's end-of-turn text
            when the response ended (a truncated one did not end its turn): what rlcli.rm.pairs.render_pair's reply
            holds after the assistant's content
Generated token ids are not reused even when the tokenizers agree: they need not be the tokenizer's own
segmentation of their text, and the reward model never saw another. The end-of-turn text is exact for templates
that render an assistant turn as its content and then fixed text (ChatML, Llama 3, SmolLM2); a template that
rewrites the content or earlier turns (one that strips a reasoning model's <think>) renders pairs otherwise, as
does a reward model whose tokenizer has another template: train the reward model on the policy's family.

The model is loaded once per process that makes batches (each training rank with synchronous rollout, each rollout
rank with asynchronous rollout). Under ZeRO-3 over several training ranks with synchronous rollout it is partitioned
like the reference model (rlcli.engine.frozen_model: each rank holds a slice, every forward gathers its layers from
all ranks): the ranks' reward stages run in step on equal batches (P / ranks x G rows), so they run the same
forwards. Elsewhere it is whole on each rank; rollout ranks score batches whose number may differ, so there it is
whole under ZeRO-3 too. Frozen, eval mode, no gradient, in bf16 under hw.precision=bf16 (else model.dtype).
Shapes: N rows of the batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlcli.core.precision import inference_dtype
from rlcli.core.schema import ConfigError
from rlcli.models.reward import score
from rlcli.rewards.config import reward_model_partitioned

EPS = 1e-6


def _whiten(raw: Tensor) -> Tensor:
    """(r - mean) / (std + EPS) over the rows, std unbiased; a single row (no spread to measure) gives 0."""
    if len(raw) < 2:
        return torch.zeros_like(raw)
    return (raw - raw.mean()) / (raw.std() + EPS)


NORMALIZERS: dict[str, Callable[[Tensor], Tensor]] = {"none": lambda raw: raw, "batch": _whiten}
"""reward.rm.normalize -> [N] raw scores to [N] values (rlcli.rewards.config.NORMALIZE names the same choices)."""


def normalized(raw: Tensor, how: str, clip: float | None) -> Tensor:
    """The `rm` part's value [N] from the raw scores [N]: NORMALIZERS[how] over the rows given (one generation
    batch), then bounded to [-clip, clip] unless clip is None."""
    value = NORMALIZERS[how](raw.float())
    return value if clip is None else value.clamp(-clip, clip)


def end_of_turn(tokenizer: Any) -> str:
    """The text `tokenizer`'s chat template puts after an assistant turn's content ("<|im_end|>\\n" for ChatML)."""
    marker = "rlcli reply marker"
    full = tokenizer.apply_chat_template([{"role": "user", "content": "rlcli prompt marker"},
                                          {"role": "assistant", "content": marker}], tokenize=False)
    if marker not in full:
        raise ValueError("the chat template drops an assistant turn's content: reward=rm cannot rebuild the text "
                         "`rlcli rm` scores; set data.chat=never, or use a model with a standard template")
    return full[full.rindex(marker) + len(marker) :]


class ModelScorer:
    """The reward model of reward=rm and what it needs to read a RolloutBatch: a scorer (rlcli.rewards.scorer) whose raw
    value is the model's score [N] fp32 on the CPU, and whose value is that normalised (`normalize`, `clip`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, policy_tokenizer: Any, chat: bool, batch_size: int,
                 normalize: str, clip: float | None):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.normalize, self.clip = normalize, clip
        self.policy_tokenizer = policy_tokenizer
        self.end_of_turn = end_of_turn(policy_tokenizer) if chat else ""

    @classmethod
    def of_run(cls, cfg: Any, policy_tokenizer: Any) -> ModelScorer:
        """reward.rm.path loaded for a run (root config `cfg`) on this process's device (cuda:LOCAL_RANK or the
        CPU), frozen; a directory without a trained score head is refused (a new head would score at random)."""
        from omegaconf import OmegaConf

        from rlcli import engine
        from rlcli.data.templates import use_chat_template
        from rlcli.models.reward import load_reward_model

        rm = cfg.reward.rm
        model_cfg = OmegaConf.merge(cfg.model, {"path": rm.path, "tokenizer_path": None, "dtype": inference_dtype(cfg),
                                                "gradient_checkpointing": False, "lora": {"r": 0}})
        loaded: dict[str, Any] = {}

        def build() -> torch.nn.Module:
            model, loaded["tokenizer"], new_head = load_reward_model(model_cfg, rm.path, cfg.seed)
            if new_head:
                raise ConfigError(f"reward.rm.path={rm.path} has no trained score head (a causal LM, not a reward "
                                  "model): train one with `rlcli rm` and pass its <run>/reward_model")
            return model

        if reward_model_partitioned(cfg):
            model = engine.frozen_model(build, cfg.hw, cfg.optim)
        else:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cfg.hw.device == "cuda" else "cpu"
            model = build().to(device).eval().requires_grad_(False)
        return cls(model, loaded["tokenizer"], policy_tokenizer, use_chat_template(cfg.data.chat, policy_tokenizer),
                   rm.batch_size, rm.normalize, rm.clip)

    def texts(self, b: Any) -> tuple[list[str], list[str]]:
        """(prompts, responses) [N] each: the texts `rlcli rm` trained on for the rows of RolloutBatch `b`."""
        prompts = self.policy_tokenizer.batch_decode([ids[m.bool()] for ids, m in zip(b.prompt_ids, b.prompt_mask)],
                                                     skip_special_tokens=False, clean_up_tokenization_spaces=False)
        responses = [text + ("" if cut else self.end_of_turn) for text, cut in zip(b.texts, b.truncated.tolist())]
        return prompts, responses

    def scores(self, b: Any) -> Tensor:
        """The reward model's score of each row of `b`: [N] fp32, batched (reward.rm.batch_size), no gradient."""
        return score(self.model, self.tokenizer, *self.texts(b), batch_size=self.batch_size)

    def __call__(self, b: Any) -> Any:
        from rlcli.rewards.scorer import Scored

        raw = self.scores(b)  # [N]
        return Scored(raw=raw, value=normalized(raw, self.normalize, self.clip))

    def close(self) -> None:
        self.model = None
