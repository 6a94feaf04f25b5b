"""What the passes keep per token: activations saved for the backward of a Llama/Qwen2 block (Korthikanti et al. 2022,
arXiv:2205.05198), the log-prob pass's fp32 logits, the KV cache of generation."""

from __future__ import annotations

from rlcli.core.layout import forward_shape
from rlcli.plan.shapes import Arch


def activation_elements_per_token(arch: Arch, seq: int, mask: bool = True) -> int:
    """Elements one Llama/Qwen2 block keeps for backward per token, counted like Korthikanti et al. 2022 §4.1
    for this block and checked with torch's saved-tensor hooks on Llama blocks with and without grouped-query
    attention (tests/test_plan.py): each RMSNorm's input and normalised input (2h each) and its weighted output
    as the next projection's input (h each), q and the attention output (heads x head_dim each), k and v at the
    query's width too (with a padding mask HF's SDPA path repeats a grouped-query model's key/value heads before
    attention, and attention keeps the repeated ones), the SwiGLU MLP's gate, SiLU(gate), up and their product
    (4 x intermediate), SDPA's log-sum-exp (one per head) and the [seq, seq] attention mask of a padded batch (seq
    per token; none under sequence parallelism, `mask` false: Ulysses attention is causal without a mask). No dropout
    masks (these models have none)."""
    q = arch.heads * arch.head_dim
    return 6 * arch.hidden + 4 * q + 4 * arch.intermediate + arch.heads + (seq if mask else 0)


def activation_bytes(arch: Arch, rows: int, seq: int, act_bytes: int, checkpointing: bool, mask: bool = True,
                     tile: int = 0, offload: bool = False) -> float:
    """Activations alive at the peak of a backward over [rows, seq] tokens. Without checkpointing every block
    keeps activation_elements_per_token; with it (HF gradient checkpointing, one checkpoint per block) each
    block keeps only its input (h per token; Korthikanti et al.: 2sbh bytes per layer in 16-bit) and the
    block being differentiated is rebuilt. Either way the backward holds the gradients of one block's
    activations at a time (one more block's worth), and the final RMSNorm keeps 3h. Under sequence parallelism `seq`
    is a rank's slice of the positions: after the all-to-all a rank attends over all positions with 1/N of the heads,
    the same number of elements. ALST's savings (rlcli.engine.alst): with `tile` > 0 (hw.tiled_mlp) a block keeps
    its MLP's input only, and the MLP's 4 x intermediate per position (and their gradients) live for one tile of
    `tile` positions of every row at a time; with `offload` (hw.offload_checkpoints) the checkpoints wait in host
    memory, not on the device."""
    tokens = rows * seq
    per_token = activation_elements_per_token(arch, seq, mask) - (4 * arch.intermediate if tile else 0)
    block = per_token * tokens * act_bytes
    final = 3 * arch.hidden * tokens * act_bytes
    mlp_tile = 2 * 4 * arch.intermediate * rows * min(tile, seq) * act_bytes if tile else 0
    checkpoints = 0 if offload else arch.layers * arch.hidden * tokens * act_bytes
    kept = checkpoints + block if checkpointing else arch.layers * block
    return kept + block + final + mlp_tile


def micro_shape(rows: int, group: int, prompt: int, response: int, share: bool) -> tuple[int, int]:
    """`forward_shape` of a micro-batch of `rows` rows from groups of `group` (G): whole groups, then the rest."""
    sizes = [group] * (rows // group) + ([rows % group] if rows % group else [])
    return forward_shape(sizes, prompt, response, share)


def logits_bytes(arch: Arch, rows: int, prompt: int, response: int, chunk: int, act_bytes: int,
                 positions: int | None = None) -> float:
    """The log-prob pass's vocabulary projection: the head's output in the activation dtype plus four fp32
    copies (the upcast logits / temperature, their log-softmax, its gradient, the entropy's softmax) of
    [rows, chunk, vocab]; chunk 0 = the whole sequence, whose head output spans the forward's `positions` (default
    rows x (prompt + response); fewer with shared prompts)."""
    if chunk:
        c = min(chunk, response)
        return rows * c * arch.vocab * (act_bytes + 16)
    positions = rows * (prompt + response) if positions is None else positions
    return arch.vocab * (positions * act_bytes + rows * response * 16)


def kv_cache_bytes(arch: Arch, rows: int, seq: int, kv_bytes: int) -> float:
    """Keys and values of every block for `rows` sequences of `seq` tokens: 2 x L x kv_heads x head_dim x bytes."""
    return kv_token_bytes(arch, 1, kv_bytes) * rows * seq


def kv_token_bytes(arch: Arch, tp: int, kv_bytes: int) -> float:
    """KV cache bytes of one token on each GPU of a `tp`-way tensor-parallel vLLM engine: each GPU holds its share of
    the KV heads, at least one (vLLM replicates KV heads when tp exceeds their number)."""
    return 2 * arch.layers * -(-arch.kv_heads // tp) * arch.head_dim * kv_bytes
