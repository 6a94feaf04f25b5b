"""One update on a synthetic batch of long rows, on each rank of a torchrun, with its peak memory beside the plan's.

    torchrun --nproc_per_node=2 tests/helpers/sequence_memory.py OVERRIDE ...
    -> one JSON line per rank on stdout: {"rank", "sp_size", "tokens": prompt + response per row,
       "before_gib": RSS with the trainer built, "peak_gib": the high-water mark after the update,
       "plan_gib": the plan's activations + logits rows (what the update adds), "plan_rows": every row in GiB}

The rows are random token ids of exactly rollout.max_new_tokens response tokens (no generation: a CPU cannot decode
long responses in reasonable time), with random advantages; the update is the learner's own (scoring skipped: an
on-policy update needs no old log-probs). Peak RSS (VmHWM) is per process, so each rank reports its own. glibc's
malloc is told to map every block of 64 KiB or more on its own (a fixed M_MMAP_THRESHOLD), so that a freed tensor
leaves the resident set: with its default, adaptive threshold the freed transients of the sequence-parallel
attention (all-to-all buffers) stay in the heap between the kept activations and the peak measures fragmentation
(+60-90 % at sp=2). Used for docs/sequence_parallel.md, "Memory measured on a CPU"."""

import ctypes
import json
import sys
import tempfile

import psutil
import torch

from rlcli.commands.launch import offline_environment
from rlcli.config import CONF_DIR, register_configs, validate
from rlcli.core.batch import RolloutBatch
from rlcli.loop.learner import rl_phase
from rlcli.loop.metrics import peak_mem_gb
from rlcli.plan.estimate import estimate
from rlcli.plan.states import GIB

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def main() -> None:
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    from hydra import compose, initialize_config_dir

    from rlcli.loop.trainer import Trainer

    offline_environment()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=sys.argv[1:])
    cfg.run_dir = tempfile.mkdtemp(prefix="rlcli-sp-memory-")
    validate(cfg)
    t = Trainer(cfg)
    r, g = cfg.rollout, torch.Generator().manual_seed(1234 + t.rank)
    rows, tp, length = t.units.P // t.units.world * t.units.G, 8, r.max_new_tokens
    vocab = t.learner.tokenizer.vocab_size
    ones = torch.ones(rows, length)
    b = RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (rows, tp), generator=g), prompt_mask=torch.ones(rows, tp, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (rows, length), generator=g), response_mask=ones,
        truncated=torch.ones(rows, dtype=torch.bool), group_index=torch.arange(rows) // t.units.G + 1000 * t.rank,
        answers=[""] * rows, texts=[""] * rows, scores=torch.zeros(rows), acc=torch.zeros(rows), loss_mask=ones,
        advantages=torch.randn(rows, length, generator=g), stale=torch.zeros(rows, dtype=torch.bool))
    plan = estimate(cfg)
    before = psutil.Process().memory_info().rss / GIB
    t.learner.update(b, rl_phase(cfg))
    print(json.dumps({"rank": t.rank, "sp_size": cfg.hw.sp_size, "tokens": tp + length, "rows": rows,
                      "before_gib": before, "peak_gib": peak_mem_gb(),
                      "plan_gib": (plan.rows["activations"] + plan.rows["logits chunk"]) / GIB,
                      "plan_rows": {k: v / GIB for k, v in plan.rows.items()}}), flush=True)
    t.rewards.close()


if __name__ == "__main__":
    main()
