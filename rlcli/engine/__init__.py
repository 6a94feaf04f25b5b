"""DeepSpeed: process group, engine construction, optimizer steps, checkpoints, saving (and, in
rlcli/engine/sequence.py, sequence parallelism's Ulysses attention; in rlcli/engine/alst.py, the tiled MLP and the
offloaded gradient checkpoints).

The policy (and the critic) are DeepSpeed engines on CPU and GPU alike (docs/design.md#engine). The loop
owns gradient accumulation: it marks the accumulation boundary itself and scales each micro-batch
loss by the world size, so a loss normalised by counts reduced over the whole mini-batch gives the
same gradient however the mini-batch is split into micro-batches and ranks (docs/algorithms.md,
"Normalizers are global").
"""

from __future__ import annotations

import functools
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlcli.core.precision import mixed_precision
from rlcli.core.topology import free_port


def init_distributed(hw: Any) -> None:
    """Join (or create) the process group. A single process gets a one-rank gloo/nccl group.

    Every collective of the group fails after hw.collective_timeout_s seconds without its peers (a dead
    or stuck rank), so no rank ever waits forever."""
    if hw.device == "cpu":  # else DeepSpeed looks for a GPU at import and warns, every run, that it fell back to the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with quiet_build_probes():
        _join(hw)


def deepspeed_module() -> Any:
    """`import deepspeed`, without the `import mlflow` it makes on the way. DeepSpeed's package imports its autotuner
    (deepspeed.runtime.config -> deepspeed.autotuning), whose module tries `import mlflow` for its own optional
    tracking; with mlflow installed (rlcli's `logger=mlflow` uses it) that costs every process 1.3-1.5 s of CPU
    (measured: `python -c "import deepspeed"` 2.8-3.2 s -> 1.6-1.9 s user time, 2 cores). rlcli never runs
    DeepSpeed's autotuner, so for the first import `mlflow` reads as absent (a None entry in sys.modules makes its
    import fail), and the entry is removed afterwards: a later `import mlflow` (the logger) loads it as usual, and a
    process that had loaded mlflow before keeps it."""
    import sys

    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hidden = "mlflow" not in sys.modules
    if hidden:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    finally:
        if hidden and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return deepspeed


@contextmanager
def quiet_build_probes() -> Iterator[None]:
    """Drop the compiler command lines DeepSpeed's op-compatibility probe echoes. The first read of
    `deepspeed.ops.__compatible_ops__` (ours below, or DeepSpeed's when it considers its shared-memory all-reduce)
    asks every op builder whether it could build; async_io's answer compiles and links a test program against
    libaio, and distutils logs each `gcc ...` command on the root logger at INFO, which Hydra's job logging prints
    on every run. Only those INFO records of distutils' are dropped: the probe, its answers, and every warning and
    error are unchanged."""
    def not_an_echo(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "distutils" not in record.pathname

    root = logging.getLogger()  # distutils logs on the root logger itself, so a filter there sees only its records
    root.addFilter(not_an_echo)
    try:
        yield
    finally:
        root.removeFilter(not_an_echo)


def _join(hw: Any) -> None:
    deepspeed_module()  # the first import, without mlflow
    import deepspeed.ops

    if hw.device == "cpu" and not hw.shm_comm:
        # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU at first init (~50 s on 2 cores).
        # Marking it incompatible makes DeepSpeed fall back to plain gloo collectives.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if hw.num_threads:
        torch.set_num_threads(hw.num_threads)
    if hw.device == "cpu" and hw.keep_freed_memory:
        keep_freed_memory()
    if dist.is_available() and dist.is_initialized():  # a second trainer, or the training ranks' own group
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)  # (asynchronous rollout)
        return
    if hw.nproc * hw.nnodes == 1:
        # One process: a private group on a free port, whatever launcher variables the environment
        # inherited (a parent process's MASTER_PORT may still be bound by that parent).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo" if hw.device == "cpu" else "nccl", verbose=False,
                               timeout=timedelta(seconds=hw.collective_timeout_s))
    if hw.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


@functools.cache
def keep_freed_memory() -> bool:
    """hw.keep_freed_memory: glibc's malloc serves every block from its heap (M_MMAP_MAX 0: no block of its own mapping,
    unmapped when freed) and returns the heap's free top to the kernel only beyond 2 GiB (M_TRIM_THRESHOLD), so freed
    tensors' memory is reused as it is, not zeroed again by page faults. -> whether glibc took both settings (False
    elsewhere: another C library leaves allocation as it is)."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt  # this process's C library
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    no_mmap, no_trim = mallopt(m_mmap_max, 0), mallopt(m_trim_threshold, 2**31 - 1)  # 1 = taken
    return no_mmap == 1 and no_trim == 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def device(hw: Any) -> torch.device:
    if hw.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def lockstep(hw: Any) -> bool:
    """Whether every forward and backward of a model is a collective: ZeRO-3 over several ranks gathers
    each layer's parameters from all ranks as it runs, so all ranks must run the same number of forward
    passes (generation steps, micro-batches, evaluation batches) in the same order."""
    return hw.zero_stage == 3 and world_size() > 1


def ds_config(hw: Any, optim: Any) -> dict[str, Any]:
    """The DeepSpeed config dict built from the `hw` and `optim` groups."""
    zero: dict[str, Any] = {"stage": hw.zero_stage}
    if hw.offload_optimizer and hw.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    if hw.offload_params and hw.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    return {
        # The loop feeds variable micro-batches and owns the boundary; these two only satisfy
        # DeepSpeed's batch bookkeeping.
        "train_micro_batch_size_per_gpu": hw.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optim.max_grad_norm,
        "zero_optimization": zero,
        # check_grad_overflow is DeepSpeed's default; spelled out because Engine.step relies on
        # the bf16 wrappers skipping a step with a non-finite gradient norm. At ZeRO-0 bf16 is rlcli's
        # autocast over fp32 weights (rlcli.core.precision.mixed_precision): DeepSpeed sees an fp32 model there.
        "bf16": {"enabled": hw.precision == "bf16" and not mixed_precision(hw), "check_grad_overflow": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@dataclass
class StepResult:
    grad_norm: float
    applied: bool


class Engine:
    """A DeepSpeed engine plus its LR schedule, with the accumulation protocol of the loop.

    Usage per optimizer step: `begin()`, then for each micro-batch `backward(loss, last=...)`,
    then `step()`. `backward` multiplies by the world size because DeepSpeed averages gradients
    over ranks, while our losses are already divided by counts reduced over all ranks.
    """

    def __init__(
        self, model: torch.nn.Module, hw: Any, optim: Any, total_steps: int,
        lr: float | None = None, warmup_steps: int | None = None,
    ):
        deepspeed_module()  # the first import, without mlflow
        import deepspeed.ops.adam
        from transformers import get_scheduler

        lr = optim.lr if lr is None else lr
        warmup_steps = optim.warmup_steps if warmup_steps is None else warmup_steps
        params = [p for p in model.parameters() if p.requires_grad]
        # With the optimizer offloaded, the Adam step runs on the CPU over the fp32 master partition:
        # DeepSpeed's vectorised CPU Adam (JIT-built once, ~50 s) in AdamW mode, the same update as torch's.
        # Else torch's AdamW, fused: one vectorised kernel per tensor (CPU and CUDA), where its default on a CPU loops
        # over ~10 elementwise ops per tensor (SmolLM2's 135M parameters: 37 ms a step against 184 ms on 2 cores). The
        # same update up to rounding (6e-8 after 5 steps of unit-scale weights, tests/test_engine.py).
        self.fused = not hw.offload_optimizer
        adamw = functools.partial(torch.optim.AdamW, fused=True) if self.fused else deepspeed.ops.adam.DeepSpeedCPUAdam
        opt = adamw(params, lr=lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay)
        self.torch_optimizer = opt
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=ds_config(hw, optim)
        )
        # The schedule drives the torch optimizer's param groups, which DeepSpeed's wrappers
        # (bf16, ZeRO >= 1) step; LambdaLR refuses the wrapper itself.
        self.scheduler = get_scheduler(
            optim.scheduler, opt, num_warmup_steps=warmup_steps, num_training_steps=max(total_steps, 1),
        )
        self.zero_stage = hw.zero_stage
        if hw.zero_stage == 3:
            _ZERO3[id(model)] = self.ds
        self.skipped_steps = 0
        # Frozen weights (a LoRA base) are rebuilt from the model path, so checkpoints leave them out.
        self.has_frozen = any(not p.requires_grad for p in model.parameters())

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.ds.set_gradient_accumulation_boundary(last)
        self.ds.backward(loss * world_size(), scale_wrt_gas=False)
        if hasattr(self.ds.optimizer, "clear_backward_seen_flag"):
            # DeepSpeed's own forward() calls this first thing: it closes the micro-step, so the next backward
            # adds to the ZeRO-3 gradient partitions instead of overwriting them (micro_step_id). The loop runs
            # its forward passes on the module itself, so it closes the micro-step here.
            self.ds.optimizer.clear_backward_seen_flag()

    def step(self) -> StepResult:
        """Apply the accumulated gradient unless its global norm is not finite (then skip and count it).

        The reported norm is the global L2 norm of the all-reduced gradient *before* clipping, the
        same number at every ZeRO stage. Where DeepSpeed wraps the optimizer (ZeRO >= 1, bf16) the
        wrapper computes that norm, skips a step whose norm is inf/NaN and says so through
        `was_step_applied()`; a plain fp32 ZeRO-0 engine steps the client optimizer unchecked, so
        there the norm comes from `p.grad` and the skip is ours. A skipped step never advances the
        LR schedule (DeepSpeed only steps a schedule it owns, and it owns none here).
        """
        own_norm = None
        if not self._ds_guards_step:
            own_norm = self._grad_norm()
            if not math.isfinite(own_norm):
                self.ds.zero_grad()  # drop the bad gradient; parameters and optimizer state untouched
                self.skipped_steps += 1
                return StepResult(own_norm, applied=False)
        self.ds.step()
        applied = bool(self.ds.was_step_applied())
        norm = own_norm if own_norm is not None else _as_float(self.ds.get_global_grad_norm())
        if applied:
            self.scheduler.step()
        else:
            self.skipped_steps += 1
        return StepResult(norm, applied=applied)

    @property
    def _ds_guards_step(self) -> bool:
        """Whether DeepSpeed's optimizer checks the gradient norm and skips a non-finite step itself.

        DeepSpeed decides `was_step_applied()` from the wrapper's `overflow` attribute
        (engine.py `_take_model_step`); the plain client optimizer (fp32, ZeRO 0) has none.
        """
        return hasattr(self.ds.optimizer, "overflow")

    def _grad_norm(self) -> float:
        """Global L2 grad norm before clipping, from the all-reduced `p.grad` (fp32 ZeRO 0 only:
        ZeRO >= 1 moves gradients into DeepSpeed's flat partitions and leaves `p.grad` None)."""
        grads = [p.grad for p in self.ds.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))

    def train(self) -> None:
        self.ds.train()

    def save(self, directory: str, tag: str) -> None:
        """DeepSpeed's checkpoint of weights and optimizer state (each rank its ZeRO partition) under
        `directory/tag`, with the LR schedule and skip count this class owns. All ranks call it."""
        state = {"rlcli_scheduler": self.scheduler.state_dict(), "rlcli_skipped_steps": self.skipped_steps}
        self.ds.save_checkpoint(directory, tag=tag, client_state=state, save_latest=False,
                                exclude_frozen_parameters=self.has_frozen)

    def load(self, directory: str, tag: str) -> None:
        """Restore what `save` wrote, optimizer moments and DeepSpeed's step counters included."""
        path, state = self.ds.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=False, load_module_strict=not self.has_frozen)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} in {directory}")
        self.scheduler.load_state_dict(state["rlcli_scheduler"])
        self.skipped_steps = state["rlcli_skipped_steps"]
        for group in self.torch_optimizer.param_groups:  # a checkpoint from before the fused AdamW says fused: None
            if "fused" in group:
                group["fused"] = self.fused


def _as_float(norm: Any) -> float:
    """DeepSpeed's norm as a float: a 0-d tensor (ZeRO 1/2), a float (bf16, overflow), or None
    (ZeRO 1/2 with compute_grad_norm off, which rlcli never sets) -> NaN."""
    if norm is None:
        return float("nan")
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)


@contextmanager
def sharded_construction(hw: Any, optim: Any) -> Iterator[None]:
    """Under ZeRO-3, models loaded with `from_pretrained` inside this block are partitioned over the ranks
    as they are built (transformers runs DeepSpeed's `zero.Init` while a `HfDeepSpeedConfig` is alive), so
    no rank ever holds a whole copy. A no-op at ZeRO 0-2. The config object lives only for the block: later
    loads (evaluation, `rlcli eval`) are ordinary."""
    if hw.zero_stage != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    alive = HfDeepSpeedConfig(ds_config(hw, optim))  # transformers holds only a weak reference to it
    try:
        yield
    finally:
        del alive


def frozen_copy(model: torch.nn.Module, hw: Any, optim: Any,
                build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """An inference-only copy of `model`'s current weights (the KL reference policy): no grads, eval mode.

    At ZeRO 0-2 a deep copy. Under ZeRO-3 `model`'s parameters are partitions, so `build()` makes a new module of
    the same architecture partitioned as it is built (frozen_model), and each rank copies its own partition of every
    parameter from `model`: nothing is gathered whole."""
    import copy

    if not is_partitioned(model):
        return _frozen(copy.deepcopy(model))
    ref = frozen_model(build, hw, optim)
    with torch.no_grad():
        for src, dst in zip(model.parameters(), ref.parameters(), strict=True):
            dst.ds_tensor.copy_(src.ds_tensor)
    return ref


def frozen_model(build: Callable[[], torch.nn.Module], hw: Any, optim: Any) -> torch.nn.Module:
    """An inference-only model made by `build()` (the distillation teacher; the reference's architecture): no grads,
    eval mode. Under ZeRO-3 it is partitioned over the ranks as it is built and DeepSpeed wraps it without an
    optimizer, so each rank holds a partition and forward passes gather layers as the policy's do."""
    if hw.zero_stage != 3:
        return _frozen(build())
    deepspeed = deepspeed_module()

    with sharded_construction(hw, optim):
        model = build()
    config = ds_config(hw, optim)
    config["zero_optimization"].pop("offload_optimizer", None)
    return _frozen(deepspeed.initialize(model=model, config=config)[0].module)


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


_ZERO3: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""id(module) -> its DeepSpeed engine, for the live ZeRO-3 engines of this process (generation_weights); an engine
leaves it when it is collected (it holds its module, so the id is not reused while it is here)."""


@contextmanager
def generation_weights(module: torch.nn.Module, gather: bool) -> Iterator[bool]:
    """With `gather` and `module` a ZeRO-3 engine's module: its whole parameters gathered once for the block (DeepSpeed's
    `unwrap_model_for_generation`: the parameters all-gathered and ZeRO-3's per-layer hooks lifted, then the hooks put
    back and the parameters partitioned again on exit), so that generation runs without a collective per decoding
    step. -> whether it gathered (every rank of the job must enter together)."""
    ds = _ZERO3.get(id(module)) if gather else None
    if ds is None or ds.module is not module:
        yield False
        return
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(ds):
        yield True


def is_partitioned(module: torch.nn.Module) -> bool:
    """Whether `module`'s parameters are ZeRO-3 partitions (each rank holds a slice of each)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of the tensors' bit patterns as integers (mod 2^64): exact and independent of order and of how the
    elements are split into tensors (a fused qkv projection, padded vocabulary rows of zeros), so the trainer's
    weights and an engine's own layout of them give the same number, and any changed bit changes it."""
    total = 0
    for t in tensors:
        bits = t.detach().contiguous().view(_INT_OF_WIDTH[t.element_size()])
        total += int(bits.to(torch.int64).sum().item())
    return total % 2**64


def full_weights(module: torch.nn.Module, tied: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) over the module's whole state dict, on every rank, one tensor at a time. Under ZeRO-3
    each parameter is gathered only while it is yielded: use or copy it before taking the next. A peft LoRA
    model yields its base weights with the adapters merged in (W + scale * B @ A) under the base model's own
    names, computed aside (the model is unchanged), and a module peft trains whole (modules_to_save: a reward
    model's head) as its trained copy under its own name. A tied weight comes under each of its names (vLLM's
    in-place reload needs lm_head.weight even when it is the input embedding), or with `tied=False` under
    its first name only (a checkpoint: transformers re-ties it on load). All ranks iterate it to the end
    together."""
    deepspeed = deepspeed_module()

    def entries(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(state.items()) if tied else untied(state)

    if hasattr(module, "get_base_model"):  # peft LoRA (refused with ZeRO-3: the weights are whole here)
        from peft.tuners.lora import LoraLayer

        base = module.get_base_model()
        delta = {name: m.get_delta_weight(m.active_adapters[0])
                 for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        for key, value in entries(base.state_dict()):
            if "lora_" in key or ".original_module." in key:  # peft's frozen copy of a module it trains whole
                continue
            if ".modules_to_save." in key:  # the trained copy (a reward model's head: task_type SEQ_CLS)
                owner, _, rest = key.partition(".modules_to_save.")
                key = f"{owner}.{rest.partition('.')[2]}"  # drop the adapter's name
            layer, _, leaf = key.rpartition(".base_layer.")
            merged = value + delta[layer] if layer in delta and leaf == "weight" else value
            yield (f"{layer}.{leaf}" if layer else key), merged.detach()
    elif not is_partitioned(module):  # ZeRO 0-2
        yield from ((n, t.detach()) for n, t in entries(module.state_dict()))
    else:
        for name, p in module.named_parameters(remove_duplicate=not tied):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield name, p.detach()
        persistent = module.state_dict().keys()
        yield from ((n, b.detach()) for n, b in module.named_buffers() if n in persistent)


def untied(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The entries of a state dict without the second name of a tied weight (lm_head.weight when it is the
    input embedding), which transformers re-ties on load."""
    seen: set[int] = set()
    for name, t in state.items():
        if t.numel() and t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        yield name, t


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """`full_weights` collected on rank 0's CPU, a tied weight under its first name (None on other ranks; peak
    beyond it: one tensor). All ranks call it."""
    weights = full_weights(module, tied=False)
    if rank() != 0:
        for _ in weights:  # join the gathers
            pass
        return None
    return {name: t.cpu().clone() for name, t in weights}


def load_full_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole state dict (as `full_state_dict` saved it) into `module`. Under ZeRO-3 rank 0 writes
    each parameter while it is gathered and DeepSpeed re-partitions it. All ranks call it."""
    deepspeed = deepspeed_module()

    if not is_partitioned(module):
        module.load_state_dict(state)
        return
    with torch.no_grad():
        for name, p in module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if rank() == 0:
                    p.copy_(state[name])


def save_policy(module: torch.nn.Module, tokenizer: Any, path: str) -> None:
    """save_pretrained + tokenizer of the full (gathered) weights, written by rank 0 to a temp dir then
    renamed so a crash never leaves half a model. A LoRA policy is saved merged (W + the adapter's
    update), as the plain transformers model AutoModelForCausalLM loads; the module is left as it was.
    All ranks call it."""
    import shutil

    state = full_state_dict(module)  # a LoRA policy merged, under its base model's names
    module = module.get_base_model() if hasattr(module, "get_base_model") else module
    if rank() != 0:
        return
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    old = path + ".old"
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
