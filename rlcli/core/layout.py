"""The shape of a forward over a micro-batch whose rows come in runs with one prompt (torch-free: the learner, the
model code and the memory plan read it alike)."""

from __future__ import annotations


def forward_shape(group_rows: list[int], prompt: int, response: int, share: bool) -> tuple[int, int]:
    """(sequences, length) of one forward over rows in runs of `group_rows` rows with the same prompt, padded to the
    longest prompt and response: a sequence of prompt + response per row, or with shared prompts (hw.share_prompts)
    one per run, its prompt then each of its rows' responses (rlcli.models.policy.Joint), where that runs fewer
    positions. Runs are padded to the longest, so runs of very different sizes (one pair among single rows) can
    cost more shared than apart: then a sequence per row."""
    rows = sum(group_rows)
    if share and len(group_rows) < rows:
        k, length = len(group_rows), prompt + max(group_rows) * response
        if k * length < rows * (prompt + response):
            return k, length
    return rows, prompt + response
