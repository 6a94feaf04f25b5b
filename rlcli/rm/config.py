"""The `rm` group's schema (conf/rm/): what `rlcli rm` trains a reward model on, and how. Torch-free.

The model, hardware, optimizer, checkpoints, logger, seed, `steps` and `run_dir` are the root config's, read
as `rlcli train` reads them (model=, hw=, optim.*, checkpoint.*): a reward model is one more DeepSpeed engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcli.core.schema import ConfigError, check_ranges, rng
from rlcli.data.config import CHAT_MODES

SOURCES = ("arith", "samples", "file")


@dataclass
class RMConfig:
    """Preference pairs and the Bradley-Terry objective of `rlcli rm` (docs/reward_models.md)."""

    name: str = "arith_pairs"
    """Preset name, for logs."""
    source: str = rng("arith", choices=SOURCES)
    """Where pairs come from: arith (the embedded task: the same prompt with a correct worked solution as `chosen`
    and a flawed one as `rejected`; operand digits from data.min_digits..data.max_digits) | samples (the model's own
    samples on the run's task, data.*, graded by the verifier: a correct and an incorrect reply to the same prompt;
    built once and cached; rlcli/rm/samples.py) | file (rm.train_path)."""
    train_path: str | None = None
    """source=file: JSONL (.jsonl/.json), Parquet (.parquet) or a `datasets.save_to_disk` directory, one pair per
    row; `pkg://rlcli/...` = a file shipped in the package."""
    eval_path: str | None = None
    """source=file: held-out pairs in the same schema; null = hold out rm.eval_fraction of rm.train_path."""
    eval_fraction: float = rng(0.1, gt=0, lt=1)
    """source=file without eval_path: share of distinct prompts held out (chosen by a hash of the prompt: seed- and
    order-independent, and no prompt is in both splits)."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a string or a chat-message list); dotted paths reach nested fields, `a|b` = the
    first present (as data.prompt_key)."""
    chosen_key: str = "chosen"
    """Column holding the preferred response (a string, or chat messages: the turns after the last user turn)."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred response, in the same form as chosen."""
    margin_key: str | None = None
    """Column holding a per-pair margin m, a finite number (Llama 2's preference-strength margin, >= 0 there,
    arXiv:2307.09288 §3.2.2): the loss becomes -log sigma(r_c - r_r - m); null = no margin."""
    chat: str = rng("auto", choices=CHAT_MODES)
    """Render each pair through the tokenizer's chat template: auto (when tokenizer.chat_template is set) | always
    (fail without one) | never (prompt + response as plain text)."""
    max_len: int = rng(512, ge=1)
    """Pairs whose longer side (prompt + response) exceeds this many tokens are dropped and counted, never cut."""
    batch_size: int = rng(32, ge=1)
    """Pairs per optimizer step, summed over all ranks (each pair is two sequences; hw.micro_batch caps the sequences
    of one forward/backward)."""
    lr: float | None = rng(None, gt=0, why="null = optim.lr")
    """Learning rate of the reward model (AdamW, with optim.scheduler, warmup and clipping); null = optim.lr."""
    center_coef: float = rng(0.0, ge=0, why="0 = off")
    """Reward-centring penalty: + center_coef * mean((r_c + r_r)^2) pulls the rewards of each pair towards a zero sum
    (Eisenstein et al. 2023, arXiv:2312.09244; TRL RewardTrainer's center_rewards_coefficient, whose docs suggest
    0.01). 0 = the plain Bradley-Terry loss (InstructGPT, Llama 2)."""
    train_size: int | None = rng(20000, ge=1, why="null = all rows")
    """Training pairs: arith generates this many; samples and files keep at most this many, in order."""
    eval_size: int | None = rng(200, ge=1, why="null = all rows")
    """Held-out pairs for eval/pair_accuracy: arith generates this many; files keep at most this many."""
    sample_prompts: int = rng(1000, ge=1)
    """source=samples: training prompts sampled, the first this many distinct prompts of data's train split (the
    held-out pairs come from every distinct prompt of data's eval split)."""
    samples_per_prompt: int = rng(8, ge=2)
    """source=samples: responses sampled per prompt, as the RL rollout samples them (rollout.temperature, top_p,
    top_k, max_new_tokens); a prompt gives pairs when at least one is correct and one incorrect."""
    sample_seed: int = rng(0, ge=0, lt=2**32)
    """source=samples: seed of the sampling (independent of `seed`, so reward models of a seed sweep share pairs)."""
    eval_every: int = rng(0, ge=0, why="0 = only before and after training")
    """Held-out pair accuracy every this many steps (0 = only before and after training)."""
    report_bad_rows: int = rng(5, ge=0)
    """How many skipped rows to report by row number and reason (all are counted)."""


def validate(cfg: Any) -> None:
    """The `rm` group's fields and the rules that relate them to the rest of an `rlcli rm` config; raise ConfigError
    naming the key and the fix. Nothing is loaded before this passes."""
    from rlcli.core.topology import asynchronous, trainer_ranks

    rm = cfg.rm
    check_ranges(rm, RMConfig, "rm.")
    if rm.source in ("arith", "samples"):
        if rm.train_path is not None or rm.eval_path is not None:
            raise ConfigError(f"rm.train_path/rm.eval_path are set but rm.source={rm.source}: set rm.source=file")
        for key in ("train_size", "eval_size"):
            if rm.source == "arith" and getattr(rm, key) is None:
                raise ConfigError(f"rm.{key}=null: the arith pairs are generated, a fixed number of them; give one")
    elif not rm.train_path:
        raise ConfigError("rm.source=file needs rm.train_path (a .jsonl, .parquet or datasets directory of "
                          f"{rm.prompt_key}/{rm.chosen_key}/{rm.rejected_key} rows)")
    world = trainer_ranks(cfg)
    if rm.batch_size % world:
        raise ConfigError(f"rm.batch_size={rm.batch_size} is not divisible by the {world} ranks (hw.nproc x "
                          "hw.nnodes): each rank trains an equal share of every batch of pairs")
    if asynchronous(cfg):
        raise ConfigError("rollout.async.max_staleness is set, but rlcli rm generates nothing: leave it null")
