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
from rlcli.core.lazy import exports
from rlcli.core.names import SCHEDULERS
from rlcli.core.schema import keyword_field, rng
from rlcli.data.config import DataConfig
from rlcli.envs.config import EnvConfig
from rlcli.models.config import CriticConfig, ModelConfig
from rlcli.rewards.config import RewardConfig, group_base
from rlcli.rm.config import RMConfig
from rlcli.rollout.config import RolloutConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
"""Hydra's config directory: the groups (algo, model, hw, reward, ...) and conf/recipe."""


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
    keep_freed_memory: bool = True
    """On a CPU under glibc: each training process keeps the memory torch frees for its next allocations (mallopt: no
    mmap for large blocks, no trimming below 2 GiB free) instead of handing it back to the kernel, which zeroes fresh
    pages at the next allocation of the same size: the SmolLM2 preset's update faulted 2.9 GiB in each time (1.4 s of
    kernel time of 5.0 s; docs/results.md). Resident memory then stays near its peak between stages. false = glibc's
    defaults."""
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


def load_frozen(path: str) -> DictConfig:
    """Load a run's frozen config.yaml (what workers do; they never run Hydra themselves)."""
    schema = OmegaConf.structured(Config)
    cfg = OmegaConf.merge(schema, OmegaConf.load(path))
    OmegaConf.set_struct(cfg, True)
    return cfg  # type: ignore[return-value]


__getattr__ = exports(__name__, {"validate": "rules"})
"""`validate` (the rules that relate fields, rlcli/config/rules.py) on first use."""
