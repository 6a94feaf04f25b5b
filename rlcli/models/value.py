"""The critic (value model) of PPO and VAPO: config, model, forward, loss.

The math: docs/algorithms.md#critic-and-other-terms; the head options: docs/algorithms.md#rlcli-options.

A value model is the policy's transformer backbone WITHOUT its LM head plus a linear value head.
The value of the state before response token t is read from the hidden state at position
tp-1+t, exactly where `rlcli.models.response_logprobs` reads the logits that predict token t.

Three heads (`critic.head`):
  scalar          one output; the paper's critic.
  multi           (rlcli option, not from a paper) K outputs, V = mean of the K heads, each head
                  trained on the same target with its own clipped loss. A gated mixture
                  V = Σ_h w_h(s)·V^(h) with learned, state-dependent weights and heads specialising
                  in length, complexity or domain would need a gating network and per-head targets
                  that have no agreed definition, so we implement the uniform-weight ensemble.
                  Unlike the scalar head, the K rows are NOT zero-initialised: identical heads get
                  identical gradients forever (same target, same features), so a zero-initialised
                  multi-head critic would be a scalar critic at K times the cost. Rows are drawn
                  N(0, (0.1/√H)²) from a fixed generator and centred across heads, so heads differ
                  while the initial V is 0 up to float rounding (~1e-9).
  distributional  (rlcli option) a categorical over `num_bins` fixed atoms linspace(v_min, v_max)
                  (C51-style support, Bellemare et al. 2017, arXiv:1707.06887); V = expectation.
                  Loss = cross-entropy to the two-hot projection of the clamped return. The clipped
                  value loss does not apply (there is no V_old-centred trust region for a
                  categorical), so `vf_clipfrac` is 0. Zero initialisation is safe here (the
                  softmax gradient p - target differs per bin) and starts from the uniform
                  distribution, i.e. V = (v_min + v_max)/2: "small" in the strongest sense.

Letters as in docs/design.md#units: n rows of a micro-batch, Tp padded prompt length (left-padded),
T padded response length (right-padded), L = Tp + T, H hidden size, K head outputs
(1 | num_heads | num_bins).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlcli.algos.functional import aggregate, hybrid_alpha, masked_mean, value_loss
from rlcli.models.config import HEADS

HEAD_FILE = "value_head.safetensors"
HEAD_JSON = "value_head.json"
HEAD_FORMAT_VERSION = 1
MULTI_HEAD_INIT_STD = 0.1
"""Std of each multi-head output at init, in units of the final hidden state's RMS."""


# ---------------------------------------------------------------------------------------------------
# The head
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueHeadSpec:
    """What the head outputs and how they become a value; saved as value_head.json.

    Fields a head kind does not use are None (multi: num_heads; distributional: num_bins, v_min,
    v_max), so two specs compare equal exactly when they describe the same head.
    """

    head: str = "scalar"
    num_heads: int | None = None
    num_bins: int | None = None
    v_min: float | None = None
    v_max: float | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> ValueHeadSpec:
        if cfg.head not in HEADS:
            raise ValueError(f"critic.head={cfg.head!r} is not a known value head; valid names: {', '.join(HEADS)}")
        if cfg.head == "multi":
            return cls("multi", num_heads=int(cfg.num_heads))
        if cfg.head == "distributional":
            return cls("distributional", num_bins=int(cfg.num_bins), v_min=float(cfg.v_min), v_max=float(cfg.v_max))
        return cls("scalar")

    @property
    def out_features(self) -> int:
        """K: 1 (scalar) | num_heads (multi) | num_bins (distributional)."""
        return {"scalar": 1, "multi": self.num_heads, "distributional": self.num_bins}[self.head]

    def support(self, device: torch.device | str | None = None) -> Tensor:
        """[num_bins] float32 atoms of the distributional head (kept out of the module so a bf16
        engine never rounds them)."""
        return torch.linspace(self.v_min, self.v_max, self.num_bins, device=device, dtype=torch.float32)

    def reduce(self, head_out: Tensor) -> Tensor:
        """Head outputs [..., K] -> values [...]: the output, the mean of heads, or E over bins."""
        if self.head == "distributional":
            return (torch.softmax(head_out.float(), -1) * self.support(head_out.device)).sum(-1)
        return head_out.float().mean(-1)


def _init_head(head: nn.Linear, spec: ValueHeadSpec) -> None:
    """Zeros for scalar and distributional, centred random rows for multi (module docstring)."""
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    if spec.head == "multi" and spec.out_features > 1:
        gen = torch.Generator().manual_seed(0)  # fixed: the critic's init is a function of the policy
        std = MULTI_HEAD_INIT_STD / head.in_features**0.5
        w = torch.randn(head.weight.shape, generator=gen, dtype=torch.float32) * std  # [K, H]
        with torch.no_grad():
            head.weight.copy_(w - w.mean(0, keepdim=True))


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    from rlcli.models import DTYPES

    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def is_critic_dir(path: str) -> bool:
    """A folder written by ValueModel.save_pretrained (it has value_head.json)."""
    return os.path.isfile(os.path.join(path, HEAD_JSON))


class ValueModel(nn.Module):
    """Backbone (a transformers base model, no LM head) + `head` nn.Linear(H, K).

    forward(input_ids, attention_mask, position_ids) -> values [n, L] float32, the value of the
    state ending at each position; `return_head_outputs=True` gives the raw head [n, L, K] instead
    (per-head values, or bin logits for distributional) for `critic_loss`.
    """

    def __init__(self, backbone: nn.Module, spec: ValueHeadSpec, head: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        self.spec = spec
        hidden = backbone.config.hidden_size
        if head is None:
            head = nn.Linear(hidden, spec.out_features)
            _init_head(head, spec)
        if (head.in_features, head.out_features) != (hidden, spec.out_features):
            raise ValueError(
                f"value head is {head.in_features}->{head.out_features} but the backbone has hidden size "
                f"{hidden} and the {spec.head} head needs {spec.out_features} outputs"
            )
        dtype = next(backbone.parameters()).dtype
        self.head = head.to(dtype)

    @property
    def config(self) -> Any:
        """The backbone's transformers config (DeepSpeed and HF helpers read `module.config`)."""
        return self.backbone.config

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_policy_path(
        cls, path: str, cfg: Any, dtype: torch.dtype | str = torch.float32, **load_kwargs: Any
    ) -> ValueModel:
        """Backbone weights of the causal LM (or any HF model) at `path`, fresh head from `cfg`.

        `load_kwargs` go to AutoModel.from_pretrained (trust_remote_code, attn_implementation).
        """
        from transformers import AutoModel

        if is_critic_dir(path):
            raise ValueError(f"{path} is a saved critic: load it with ValueModel.from_pretrained (or load_critic)")
        backbone = AutoModel.from_pretrained(path, dtype=_torch_dtype(dtype), **load_kwargs)
        return cls(backbone, ValueHeadSpec.from_config(cfg))

    @classmethod
    def from_causal_lm(cls, model: nn.Module, cfg: Any) -> ValueModel:
        """A critic whose backbone is a deep copy of an in-memory causal LM's base model."""
        return cls(copy.deepcopy(model.base_model), ValueHeadSpec.from_config(cfg))

    @classmethod
    def from_pretrained(
        cls, path: str, cfg: Any | None = None, dtype: torch.dtype | str = torch.float32, **load_kwargs: Any
    ) -> ValueModel:
        """Load a critic written by `save_pretrained`. With `cfg`, its head must match the saved one."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        if not is_critic_dir(path):
            raise ValueError(
                f"{path} has no {HEAD_JSON}, so it is not a saved rlcli critic; to start a critic from a "
                "model's backbone use ValueModel.from_policy_path (load_critic does this for critic.path)"
            )
        with open(os.path.join(path, HEAD_JSON)) as f:
            meta = json.load(f)
        spec = ValueHeadSpec(**{k: meta[k] for k in ("head", "num_heads", "num_bins", "v_min", "v_max")})
        if cfg is not None and ValueHeadSpec.from_config(cfg) != spec:
            raise ValueError(
                f"the critic at {path} has head {spec}, but the config asks for "
                f"{ValueHeadSpec.from_config(cfg)}: set critic.head/num_heads/num_bins/v_min/v_max to "
                "the saved values, or set critic.path=null to start a fresh critic from the policy"
            )
        backbone = AutoModel.from_pretrained(path, dtype=_torch_dtype(dtype), **load_kwargs)
        state = load_file(os.path.join(path, HEAD_FILE))
        head = nn.Linear(meta["hidden_size"], spec.out_features)
        head.load_state_dict(state)
        return cls(backbone, spec, head)

    def save_pretrained(self, path: str, state_dict: dict[str, Tensor] | None = None) -> None:
        """Backbone (save_pretrained) + value_head.safetensors + value_head.json, written to
        `path`.tmp and renamed, so a crash never leaves a half-written critic at `path`. `state_dict`:
        this module's full state (gathered under ZeRO-3) instead of its own tensors."""
        from safetensors.torch import save_file

        state = self.state_dict() if state_dict is None else state_dict
        part = {name: {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(name + ".")}
                for name in ("backbone", "head")}
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.backbone.save_pretrained(tmp, state_dict=part["backbone"], safe_serialization=True)
        head = {k: v.detach().cpu().contiguous() for k, v in part["head"].items()}
        save_file(head, os.path.join(tmp, HEAD_FILE))
        meta = {"format_version": HEAD_FORMAT_VERSION, **asdict(self.spec), "hidden_size": self.head.in_features}
        with open(os.path.join(tmp, HEAD_JSON), "w") as f:
            json.dump(meta, f, indent=2)
        old = path + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    # ----------------------------------------------------------------- forward
    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, return_head_outputs: bool = False
    ) -> Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [n, L, H]
        head_out = self.head(hidden).float()  # [n, L, K]
        return head_out if return_head_outputs else self.spec.reduce(head_out)  # [n, L, K] | [n, L]

    def logits(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """Bin logits [n, L, num_bins] of the distributional head."""
        if self.spec.head != "distributional":
            raise ValueError(f"logits() exists for the distributional head only; this critic's head is {self.spec.head}")
        return self(input_ids, attention_mask, position_ids, return_head_outputs=True)


def load_critic(cfg: Any, policy_path: str, dtype: torch.dtype | str = torch.float32, **load_kwargs: Any) -> ValueModel:
    """The critic `cfg` asks for: from the policy (path null), a saved critic, or another model's backbone."""
    if cfg.path is None:
        return ValueModel.from_policy_path(policy_path, cfg, dtype, **load_kwargs)
    if is_critic_dir(cfg.path):
        return ValueModel.from_pretrained(cfg.path, cfg, dtype, **load_kwargs)
    return ValueModel.from_policy_path(cfg.path, cfg, dtype, **load_kwargs)


# ---------------------------------------------------------------------------------------------------
# Values at response positions
# ---------------------------------------------------------------------------------------------------


def response_head_outputs(
    critic: nn.Module,
    prompt_ids: Tensor,  # [n, Tp]
    prompt_mask: Tensor,  # [n, Tp]
    response_ids: Tensor,  # [n, T]
    token_mask: Tensor,  # [n, T] RolloutBatch.token_mask
    share: bool = False,
    sp: Any = None,
) -> Tensor:
    """Raw head outputs [n, T, K] for the state before each response token; 0 at masked positions.

    Same layout (`rlcli.models.policy.joint`: shared prompts with `share`; `slices` with a sequence-parallel group
    `sp`), position ids and positions as `rlcli.models.response_logprobs`: the hidden state before token t has seen
    the prompt and response tokens < t, and position ids count only real tokens, so extra left padding of a prompt
    changes nothing.
    """
    from rlcli.models.policy import joint, sharing, slices

    device = next(critic.parameters()).device
    layout = (joint(prompt_ids, prompt_mask, response_ids, token_mask, device, sharing(critic, share)) if sp is None
              else slices(prompt_ids, prompt_mask, response_ids, token_mask, device, sp))
    head_out = critic(**layout.inputs, return_head_outputs=True)
    head_out = layout.pick(head_out).float()  # [n, T, K] state before each response token (fp32 under autocast)
    valid = token_mask.to(device).bool()[..., None]  # [n, T, 1]
    return torch.where(valid, head_out, torch.zeros_like(head_out))


def response_values(
    critic: nn.Module,
    prompt_ids: Tensor,  # [n, Tp]
    prompt_mask: Tensor,  # [n, Tp]
    response_ids: Tensor,  # [n, T]
    token_mask: Tensor,  # [n, T] RolloutBatch.token_mask
    share: bool = False,
    sp: Any = None,
) -> Tensor:
    """Values [n, T] float32 of the state before each response token; exactly 0 at masked positions."""
    head_out = response_head_outputs(critic, prompt_ids, prompt_mask, response_ids, token_mask, share, sp)  # [n, T, K]
    values = critic.spec.reduce(head_out)  # [n, T]
    valid = token_mask.to(values.device).bool()
    return torch.where(valid, values, torch.zeros_like(values))


# ---------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------


def two_hot(x: Tensor, v_min: float, v_max: float, num_bins: int) -> Tensor:
    """Project scalars onto the atoms linspace(v_min, v_max, num_bins). Shapes: [...] -> [..., B].

    x is clamped to [v_min, v_max]; a value between atoms z_j ≤ x < z_{j+1} puts weight
    (z_{j+1} - x)/Δ on j and (x - z_j)/Δ on j+1, so Σ_b p_b z_b = x (the expectation is exact).
    """
    pos = (x.float().clamp(v_min, v_max) - v_min) / (v_max - v_min) * (num_bins - 1)  # [...] in [0, B-1]
    lo = pos.floor().clamp(max=num_bins - 1)
    w_hi = pos - lo  # 0 at the top edge, where lo = hi = B-1
    lo = lo.long()
    hi = (lo + 1).clamp(max=num_bins - 1)
    out = torch.zeros(*x.shape, num_bins, dtype=torch.float32, device=x.device)
    out.scatter_add_(-1, lo[..., None], (1.0 - w_hi)[..., None])
    out.scatter_add_(-1, hi[..., None], w_hi[..., None])
    return out


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(ret - V)/(Var(ret) + 1e-8) over valid tokens, the same definition as `value_loss`."""
    return value_loss(values.detach(), values.detach(), returns, mask, clip_range=None)[1]["explained_var"]


def critic_loss(
    head_out: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    spec: ValueHeadSpec,
    clip_range: float | None = 0.5,
    num_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss of one micro-batch, token_mean with the mini-batch normalizer (docs/algorithms.md).

    Shapes: head_out [n, T, K] from `response_head_outputs` (with grad); old_values, returns,
    mask [n, T]; num_tokens = valid tokens of the whole optimizer mini-batch (all micro-batches,
    all ranks; default: this micro-batch), so summing micro-batch gradients equals the big batch.
      scalar          functional.value_loss: ½·max((V - ret)², (clip(V, V_old ± ε) - ret)²)
      multi           the same per head V_k, clipped around the stored ensemble V_old (per-head old
                      values are not kept), averaged over heads; V = mean_k V_k
      distributional  -Σ_b two_hot(ret)_b · log softmax(logits)_b; clip_range is ignored
    metrics (detached): vf_loss (this micro-batch's share: sums to the mini-batch loss),
    vf_clipfrac, explained_var, values_mean (means over this micro-batch); multi adds vf_head_std
    (mean spread of the heads), distributional adds vf_return_clamped (fraction of returns outside
    [v_min, v_max]). explained_var is not additive over micro-batches: for the step's true value
    log `explained_variance(batch.values, batch.returns, mask)` once.
    """
    m = mask.bool() if mask.dtype != torch.bool else mask
    returns = torch.where(m, returns, torch.zeros_like(returns))  # masked garbage (even NaN) never counts
    values = spec.reduce(head_out)  # [n, T]
    if spec.head == "distributional":
        logits = head_out.float()  # [n, T, B]
        target = two_hot(returns, spec.v_min, spec.v_max, spec.num_bins)  # [n, T, B]
        ce = -(target * torch.log_softmax(logits, -1)).sum(-1)  # [n, T]
        loss = aggregate(ce, m, "token_mean", num_tokens=num_tokens)
        metrics = value_loss(values.detach(), old_values, returns, m, clip_range=None)[1]
        metrics["vf_clipfrac"] = torch.zeros_like(metrics["vf_clipfrac"])
        outside = (returns < spec.v_min) | (returns > spec.v_max)
        metrics["vf_return_clamped"] = masked_mean(outside.float(), m)
    elif spec.head == "multi":
        per_head = [
            value_loss(head_out[..., k], old_values, returns, m, clip_range, num_tokens)
            for k in range(spec.out_features)
        ]
        loss = torch.stack([lk for lk, _ in per_head]).mean()
        metrics = value_loss(values.detach(), old_values, returns, m, clip_range)[1]
        metrics["vf_clipfrac"] = torch.stack([mk["vf_clipfrac"] for _, mk in per_head]).mean()
        metrics["vf_head_std"] = masked_mean(head_out.detach().std(-1, unbiased=False), m)
    else:
        loss, metrics = value_loss(values, old_values, returns, m, clip_range, num_tokens)
    metrics["vf_loss"] = loss.detach()
    return loss, metrics


# ---------------------------------------------------------------------------------------------------
# Value augmentation (rlcli option, not from a paper; docs/algorithms.md#rlcli-options)
# ---------------------------------------------------------------------------------------------------


def augmented_values(
    v_critic: Tensor, v_pretrained: Tensor, step: int, total_steps: int, w0: float, kappa: float
) -> Tensor:
    """V_aug = w(t)·V_pretrained + (1 - w(t))·V_critic, w(t) = w0·exp(-κ·t/T) (rlcli option).

    Shapes: [N, T] -> [N, T] (0 where both inputs are 0, i.e. at masked positions). The weight is a
    fixed schedule; it does not adapt to how reliable the critic has become.
    `total_steps` below 1 counts as 1 (same schedule function as the VAPO-GRPO hybrid's α(t)).
    """
    w = hybrid_alpha(step, total_steps, w0, kappa)
    return w * v_pretrained + (1.0 - w) * v_critic
