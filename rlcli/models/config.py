"""Schemas of the model groups (the embedded tiny model, its warm start, the critic) and the tiny
vocabulary, importable without torch: composing and validating a config never imports torch (rlcli.config)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlcli.core.names import ATTN_IMPLEMENTATIONS, MODEL_DTYPES
from rlcli.core.precision import trained_model
from rlcli.core.schema import ConfigError, check_ranges, rng

TOKENIZER_DIR = Path(__file__).parent / "tokenizer"
"""The tiny model's character tokenizer, shipped in the package (rlcli/models/tiny.py builds the same)."""
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Printable ASCII plus newline: enough for math prompts, worked steps and `\boxed{}`.
CHARS = tuple(chr(i) for i in range(32, 127)) + ("\n",)

HEADS = ("scalar", "multi", "distributional")
"""Value heads (rlcli/models/value.py)."""


@dataclass
class TinyModelConfig:
    """Shape of the embedded Llama (defaults give 4.2M parameters, docs/design.md#tiny-model)."""

    hidden_size: int = rng(256, ge=1)
    """Width of the residual stream."""
    num_layers: int = rng(4, ge=1)
    """Number of transformer blocks."""
    num_heads: int = rng(4, ge=1)
    """Attention heads per block (head dim = hidden_size / num_heads)."""
    intermediate_size: int = rng(1024, ge=1)
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = rng(512, ge=1)
    """Longest prompt + response the model is built for, in tokens (= characters)."""
    rope_theta: float = rng(10000.0, gt=0)
    """RoPE base frequency."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the LM head (saves vocab*hidden parameters)."""
    attn_implementation: str = rng("sdpa", choices=("sdpa", "eager"))
    """'sdpa' or 'eager' (no clear speed difference measured on 2 loaded CPU threads)."""


@dataclass
class WarmStartConfig:
    """Supervised warm-start of the tiny model before RL (cached; see rlcli/models/sft.py)."""

    enabled: bool = True
    """Train before RL; if false the cached 'checkpoint' is the random initialisation."""
    steps: int = rng(200, ge=1, why="model.warm_start.enabled=false skips the warm start")
    """Optimizer steps of supervised training (calibrated: 46.5% held-out greedy acc by default, docs/results.md)."""
    batch_size: int = rng(32, ge=1)
    """Examples per optimizer step; every example is new (steps * batch_size problems)."""
    lr: float = rng(1e-3, gt=0)
    """Peak AdamW learning rate (2e-3 learned slower and 3e-3 stalled: module docstring)."""
    warmup: int = rng(10, ge=0)
    """Linear warmup steps, then cosine decay to 0."""
    seed: int = rng(0, ge=0, lt=2**32)
    """Seed of model init, training order and the sampled-accuracy probe."""
    carry_slip: float = rng(0.6, ge=0, le=1)
    """Chance that a demonstration forgets each carry it should take (imperfect SFT data; module doc)."""
    tool_demos: float = rng(0.0, ge=0, le=1)
    """Share of demonstrations solved with the calculator tool instead (env=calculator; rlcli/envs/calculator.py)."""
    eval_size: int = rng(200, ge=1)
    """Held-out problems used to measure greedy and sampled accuracy after training."""
    cache_dir: str | None = None
    """Cache root; None means $RLCLI_CACHE, else ~/.cache/rlcli. Not part of the cache key."""


@dataclass
class CriticConfig:
    """The value model: where it starts, its head, its optimiser, VAPO pretraining (docs/algorithms.md)."""

    path: str | None = None
    """null = initialise the backbone from the policy's weights; else a saved rlcli critic (a folder with value_head.json: head loaded too) or any HF model folder (backbone only, fresh head; e.g. a reward model, as in VAPO)."""
    lr: float = rng(1e-4, gt=0)
    """Critic AdamW learning rate (tiny-model scale; the VAPO paper's 2e-6 belongs in model presets)."""
    warmup_steps: int = rng(0, ge=0)
    """Linear LR warmup of the critic, in critic optimizer steps."""
    head: str = rng("scalar", choices=HEADS)
    """Value head: scalar | multi (mean of num_heads heads) | distributional (categorical over num_bins atoms); multi and distributional are rlcli options, not from a paper."""
    num_heads: int = rng(4, ge=1)
    """multi: K heads, each trained on the same target with its own clipped loss; V = their mean (uniform weights, no learned gates; see rlcli/models/value.py)."""
    num_bins: int = rng(51, ge=2)
    """distributional: atoms of the fixed support linspace(v_min, v_max)."""
    v_min: float = rng(-1.0)
    """distributional: lowest atom; returns below it are clamped (set the support to cover reward range incl. penalties)."""
    v_max: float = rng(1.0)
    """distributional: highest atom; returns above it are clamped."""
    pretrain_steps: int = rng(50, ge=1, why="algo.value_pretrain=false turns value pretraining off")
    """VAPO value pretraining K, when algo.value_pretrain is on: critic-only steps on rollouts of the frozen initial policy with Monte-Carlo returns (λ = 1) before any actor update (VAPO §5.1: "value network warmup for 50 steps")."""
    pretrain_ev_threshold: float | None = rng(None, le=1, why="explained variance never exceeds 1; null = run all pretrain_steps")
    """rlcli option: stop value pretraining early once the explained variance of a fresh batch reaches this (e.g. 0.8); null = run all pretrain_steps."""
    aug_w0: float | None = rng(None, ge=0, le=1, why="null = off")
    """rlcli option (not from a paper), value augmentation: advantages use V_aug = w(t)·V_pretrained + (1 - w(t))·V_critic, w(t) = w0·exp(-κ t/T), V_pretrained frozen after pretraining; null = off."""
    aug_kappa: float = rng(5.0, ge=0)
    """κ: decay rate of the augmentation weight w(t) = w0·exp(-κ t/T)."""


def validate_critic(cfg: Any) -> None:
    """Every field of a CriticConfig (or the composed `critic` node) against its declared range, and v_min < v_max;
    raise ConfigError naming the key."""
    check_ranges(cfg, CriticConfig, "critic.")
    if not cfg.v_min < cfg.v_max:
        raise ConfigError(f"critic.v_min={cfg.v_min} must be < critic.v_max={cfg.v_max}")


def validate_tiny(cfg: Any) -> None:
    """The tiny model's shape: the heads split the width evenly."""
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"model.tiny.hidden_size={cfg.hidden_size} must be divisible by "
                          f"model.tiny.num_heads={cfg.num_heads} (head dim = hidden_size / num_heads)")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""What a Hugging Face Hub model id looks like (`org/name`): verl and TRL users pass one as the model path."""


def download_hint(hub_id: str) -> str:
    """How to get a hub model onto this machine, for messages: rlcli never downloads."""
    local = f"models/{hub_id.rsplit('/', 1)[-1].lower()}"
    return f"`hf download {hub_id} --local-dir {local}` on a machine with network, copy {local} here, then model.path={local}"


def check_model_path(model_cfg: Any) -> None:
    """`rlcli train` and `rlcli eval`, before anything loads (not `rlcli plan`, which needs no weights): model.path
    and model.tokenizer_path name a local directory (model.path: one holding config.json), or a hub id whose files
    are already in the local Hugging Face cache (runs are offline). Raises ConfigError naming the key and the fix."""
    import os

    for key in ("path", "tokenizer_path"):
        value = getattr(model_cfg, key)
        if value is None:
            continue
        local = os.path.expanduser(value)
        if os.path.isdir(local):
            if key == "path" and not os.path.isfile(os.path.join(local, "config.json")):
                held = sorted(os.listdir(local))
                shown = ", ".join(held[:6]) + (", ..." if len(held) > 6 else "") if held else "nothing"
                raise ConfigError(
                    f"model.path={value} has no config.json (it holds {shown}): point model.path at a Hugging Face "
                    "model directory, the one holding config.json and the weights (*.safetensors), as written by "
                    "save_pretrained or `hf download`; a GGUF file goes in model.gguf_file"
                )
            continue
        if os.path.exists(local):
            gguf = " (a GGUF file: model.gguf_file=" + value + " model.path=null)" if value.endswith(".gguf") else ""
            raise ConfigError(f"model.{key}={value} is a file, not a model directory{gguf}: point it at the directory "
                              "holding config.json and the weights")
        # org/name is a hub id, unless org is a local folder (then it is a mistyped path)
        if HUB_ID.fullmatch(value) and not os.path.isdir(os.path.expanduser(value.split("/")[0])):
            if _in_hub_cache(value, ("config.json",) if key == "path" else ("tokenizer_config.json", "tokenizer.json")):
                continue  # transformers loads it from the cache, offline
            raise ConfigError(
                f"model.{key}={value} is neither a local directory nor a model in the Hugging Face cache, and rlcli "
                f"runs offline (it downloads nothing): download the model first, {download_hint(value)}"
            )
        raise ConfigError(f"model.{key}={value}: no such directory; point it at a local model directory (the one "
                          "holding config.json), e.g. one written by save_pretrained")


def _in_hub_cache(hub_id: str, files: tuple[str, ...]) -> bool:
    """One of the hub model's `files` is in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME); no network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    try:
        return any(isinstance(try_to_load_from_cache(hub_id, name), str) for name in files)
    except Exception:  # an id huggingface_hub refuses (HFValidationError) is not in the cache either
        return False


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy (Hu et al. 2021, arXiv:2106.09685), through peft (`pip install
    rlcli[lora]`). Only the adapters train; the reference policy is the base model with the adapters
    disabled (no second copy); checkpoints hold the adapters; the saved policy is merged."""

    r: int = rng(0, ge=0, why="0 = no LoRA")
    """Adapter rank (0 = no LoRA: every weight trains)."""
    alpha: float = rng(16.0, gt=0)
    """Scale: the adapter's update is multiplied by alpha / r."""
    dropout: float = rng(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers that get adapters (Llama / Qwen2 attention and MLP projections)."""

@dataclass
class ArchConfig:
    """Architecture facts for `rlcli plan` (docs/memory.md), copied from a hub model's config.json, so the memory
    estimate needs no download. Read only when model.path is a hub id: a local model.path has its config.json
    read instead, and the embedded tiny model (model.path null) is sized by model.tiny.*."""

    hidden_size: int | None = rng(None, ge=1)
    """Width of the residual stream (config.json hidden_size)."""
    num_hidden_layers: int | None = rng(None, ge=1)
    """Transformer blocks."""
    intermediate_size: int | None = rng(None, ge=1)
    """Width of the SwiGLU MLP."""
    vocab_size: int | None = rng(None, ge=1)
    """Rows of the embedding and of the output projection."""
    num_attention_heads: int | None = rng(None, ge=1)
    """Query heads."""
    num_key_value_heads: int | None = rng(None, ge=1)
    """Key/value heads (grouped-query attention); null = num_attention_heads."""
    head_dim: int | None = rng(None, ge=1)
    """Per-head width; null = hidden_size / num_attention_heads."""
    tie_word_embeddings: bool = False
    """The output projection shares the input embedding's weights."""
    attention_bias: bool = False
    """The q, k and v projections have biases (Qwen2: true; Llama: false)."""

@dataclass
class ModelConfig:
    name: str = "tiny"
    """Preset name, for logs and run names."""
    path: str | None = None
    """A local directory or hub id loaded with AutoModelForCausalLM; null = the embedded tiny model (warm-started),
    or the model.gguf_file."""
    gguf_file: str | None = None
    """A local GGUF file (or pkg:<package>/<file> inside an installed package), converted once into rlcli's cache
    as a Hugging Face directory, keyed by the file's content (rlcli/models/gguf.py); used when model.path is null."""
    tokenizer_path: str | None = None
    """Tokenizer location if it differs from `path`."""
    dtype: str = rng("float32", choices=MODEL_DTYPES)
    """Weights dtype when loading: float32 | bfloat16 (fp16 is refused on CPU by DeepSpeed)."""
    attn_implementation: str | None = rng(None, choices=ATTN_IMPLEMENTATIONS)
    """transformers attention backend (eager | sdpa | flash_attention_2); null = library default."""
    trust_remote_code: bool = False
    """Passed to from_pretrained for hub models that ship their own code."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning of the policy (model.lora.r > 0)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (large models); the policy and the critic."""
    arch: ArchConfig = field(default_factory=ArchConfig)
    """Architecture of a hub model for the memory planner (`rlcli plan`); presets set it."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Architecture of the embedded tiny Llama (used when `path` is null)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm-start of the tiny model on the embedded task (built on first use, cached)."""

def teacher_model(cfg: Any) -> Any:
    """distill.teacher as a model config, trained-model dtype, no adapters, no checkpointing: the `model:` node of a
    model preset (conf/model/<name>.yaml, resolved as `model=<name>` resolves: a GGUF conversion, the tiny model's
    warm start, cached), or cfg.model pointed at a local directory."""
    name = cfg.distill.teacher
    preset = Path(__file__).resolve().parent.parent / "conf" / "model" / f"{name}.yaml"
    frozen = {"dtype": trained_model(cfg).dtype, "lora": {"r": 0}, "gradient_checkpointing": False}
    if "/" not in name and preset.is_file():
        return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(preset).model, frozen)
    return OmegaConf.merge(cfg.model, {"path": name, "tokenizer_path": None, "gguf_file": None}, frozen)
