"""Checks of the model keys that read files but load no weights and no torch (`rlcli train` answers a mistake in about a
second): where the tokenizer comes from, and whether a distillation teacher shares the student's vocabulary."""

from __future__ import annotations

from typing import Any

from rlcli.core.schema import ConfigError
from rlcli.models.config import TOKENIZER_DIR


def tokenizer_source(model_cfg: Any) -> str:
    """Where the run's tokenizer loads from, without resolving the weights: model.tokenizer_path, model.path, the
    conversion of model.gguf_file (converted now if not cached), or the tiny model's shipped tokenizer (its warm
    start saves the same one)."""
    if model_cfg.tokenizer_path or model_cfg.path:
        return model_cfg.tokenizer_path or model_cfg.path
    if model_cfg.gguf_file:
        from rlcli.models.gguf import converted

        return converted(model_cfg.gguf_file)
    return str(TOKENIZER_DIR)


def check_teacher(cfg: Any) -> None:
    """`rlcli train` with distill.teacher, before any weights load: a model directory whose tokenizer is the student's
    (every token the same id), since the teacher scores the student's token ids. Reads the two vocabularies only."""
    import os

    teacher = cfg.distill.teacher
    if not teacher or teacher == "self":  # self-distillation: the student's own weights and tokenizer
        return
    from rlcli.models.config import teacher_model

    model = teacher_model(cfg)
    if model.path and not os.path.isfile(os.path.join(os.path.expanduser(teacher), "config.json")):
        raise ConfigError(f"distill.teacher={teacher} is neither a model directory (no config.json there) nor a model "
                          "preset (conf/model/): point it at a Hugging Face model directory, e.g. a trained run's "
                          "<run>/policy, or name a preset, e.g. tiny_exact_carry")
    student_dir = tokenizer_source(cfg.model)
    student, theirs = (_vocab(d) or _load_vocab(d, cfg.model.trust_remote_code)
                       for d in (student_dir, tokenizer_source(model)))
    if theirs != student:
        moved = sum(theirs.get(tok) != i for tok, i in student.items())
        raise ConfigError(
            f"distill.teacher={teacher} has another tokenizer than the student's ({student_dir}): {len(theirs)} "
            f"tokens against {len(student)}, {moved} of the student's tokens missing or at another id. The teacher "
            "scores the student's token ids, so both need one vocabulary: choose a teacher of the student's family "
            "(e.g. a trained run of this model, <run>/policy)")


def _vocab(directory: str) -> dict[str, int] | None:
    """token -> id of a fast tokenizer's tokenizer.json (its model's vocabulary and the added tokens), read as JSON
    (no transformers import: the check stays fast); None without that file."""
    import json
    import os

    path = os.path.join(os.path.expanduser(directory), "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        spec = json.load(f)
    vocab = spec["model"].get("vocab") or {}
    out = dict(vocab) if isinstance(vocab, dict) else {tok: i for i, (tok, _) in enumerate(vocab)}  # Unigram: a list
    out.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
    return out


def _load_vocab(directory: str, trust_remote_code: bool) -> dict[str, int]:
    from rlcli.models.policy import load_tokenizer

    return load_tokenizer(directory, trust_remote_code).get_vocab()
