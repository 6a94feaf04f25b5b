"""Shared-prompt forward (hw.share_prompts, rlcli.models.policy.Joint): each group's prompt is computed once per
micro-batch and its responses attend to that one copy. What a row gets (log-probs, entropy, the full-vocabulary KL,
values) and the gradient of any loss on them must equal a forward per row up to fp32 rounding: 1e-6.

Run: pytest -q tests/test_shared_prompt.py (CPU, seconds). A 2-layer tiny Llama at random init; prompts of different
lengths (left padding), responses of different lengths (right padding) and a real token the loss ignores (a
tool observation: in token_mask, not in the loss mask), groups of 3, 1 and 3 rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlcli.core.batch import RolloutBatch
from rlcli.core.layout import forward_shape
from rlcli.loop.learner import Learner
from rlcli.models.config import CriticConfig, TinyModelConfig
from rlcli.models.policy import (
    joint,
    prompt_runs,
    prompt_sharing_for,
    response_log_softmax,
    response_outputs,
    with_lora,
)
from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer
from rlcli.models.value import ValueModel, response_head_outputs

SMALL = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
RUNS = [3, 1, 3]  # rows per prompt
PROMPT_LEN = [5, 9, 2]  # real prompt tokens per group (Tp = 9)
RESPONSE_LEN = [6, 2, 4, 6, 1, 3, 5]  # real response tokens per row (T = 6)


def batch(vocab: int, pad: int) -> tuple[torch.Tensor, ...]:
    """(prompt_ids [7, 9], prompt_mask, response_ids [7, 6], token_mask, loss_mask): rows of one group side by side."""
    g = torch.Generator().manual_seed(0)
    tp, t = max(PROMPT_LEN), max(RESPONSE_LEN)
    prompt_ids, prompt_mask = [], []
    for rows, length in zip(RUNS, PROMPT_LEN):
        ids = torch.full((tp,), pad)
        ids[tp - length:] = torch.randint(5, vocab, (length,), generator=g)
        mask = (ids != pad).long()
        prompt_ids += [ids] * rows
        prompt_mask += [mask] * rows
    response_ids = torch.randint(5, vocab, (len(RESPONSE_LEN), t), generator=g)
    token_mask = (torch.arange(t) < torch.tensor(RESPONSE_LEN)[:, None]).long()
    response_ids[token_mask == 0] = pad
    loss_mask = token_mask.clone()
    loss_mask[0, 2:4] = 0  # row 0's tokens 2-3 are an observation: read by the model, not trained on
    return torch.stack(prompt_ids), torch.stack(prompt_mask), response_ids, token_mask, loss_mask


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal up to fp32 summation order: 1e-6 of each tensor's largest entry."""
    assert a.keys() == b.keys() and a
    for name, g in a.items():
        assert (b[name] - g).abs().max() <= 1e-6 * g.abs().max() + 1e-12, name


def test_the_layout_puts_each_prompt_once_and_shows_a_response_only_its_prompt_and_itself(tokenizer):
    prompt_ids, prompt_mask, response_ids, token_mask, _ = batch(len(tokenizer), tokenizer.pad_token_id)
    assert prompt_runs(prompt_ids, prompt_mask) == RUNS
    layout = joint(prompt_ids, prompt_mask, response_ids, token_mask, torch.device("cpu"), "sdpa")
    tp, t = 9, 6
    assert layout.runs == RUNS and layout.inputs["input_ids"].shape == (3, tp + 3 * t)  # 3 x 27 = 81 positions
    assert forward_shape(RUNS, tp, t, True) == (3, 27) and forward_shape(RUNS, tp, t, False) == (7, 15)  # the planner's
    mask = layout.inputs["attention_mask"][:, 0]  # [3, 27, 27]
    first, second, third = tp, tp + t, tp + 2 * t  # group 0: the first column of its rows' responses (6, 2, 4 tokens)
    assert mask[0, third, tp - 5 : tp].all() and not mask[0, third, : tp - 5].any()  # real prompt tokens, no padding
    assert not mask[0, third, first:third].any()  # not the other responses of its group
    assert mask[0, third + 3, third : third + 4].all() and not mask[0, third + 3, third + 4 :].any()  # causal
    assert not mask[0, third + 3, second + 2 : second + t].any()  # nor padding
    # Position ids continue from the prompt's real length in every segment, as in the row's own sequence.
    assert layout.inputs["position_ids"][0, third : third + 4].tolist() == [5, 6, 7, 8]
    # The state before a response's first token is the prompt's last, shared by its group's rows.
    assert layout.at[0, 0] == layout.at[1, 0] == tp - 1 and layout.at[1, 1] == second
    # Nothing to share (every prompt different, or an attention without custom masks): a sequence per row.
    assert joint(prompt_ids, prompt_mask, response_ids, token_mask, torch.device("cpu"), None).runs is None
    assert joint(prompt_ids[2:4], prompt_mask[2:4], response_ids[2:4], token_mask[2:4], torch.device("cpu"),
                 "sdpa").runs is None


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompts_give_every_row_its_own_outputs_and_gradient(tokenizer, attention, chunk):
    """Log-probs, entropy and the full-vocabulary reverse KL at every response token, and the gradient of a loss on
    all three (weighted per row, masked like the update's), equal a forward per row: with the whole-sequence and the
    chunked vocabulary projection, with SDPA's boolean and eager attention's additive mask."""
    model = build_tiny_model(TinyModelConfig(**SMALL, attn_implementation=attention), tokenizer, 0).eval()
    prompt_ids, prompt_mask, response_ids, token_mask, loss_mask = batch(len(tokenizer), tokenizer.pad_token_id)
    inputs = (prompt_ids, prompt_mask, response_ids, token_mask)
    other = torch.log_softmax(torch.randn(*response_ids.shape, len(tokenizer), generator=torch.Generator().manual_seed(1)), -1)
    weight = torch.linspace(-1, 1, len(RESPONSE_LEN))[:, None]  # a different advantage per row
    out = {}
    for share in (False, True):
        model.zero_grad()
        logp, entropy, kl = response_outputs(model, *inputs, 0.7, True, True, chunk, kl_to=other, share=share)
        ((logp * weight + 0.1 * entropy + 0.3 * kl) * loss_mask).sum().backward()
        out[share] = (logp * token_mask, entropy * token_mask, kl * token_mask, grads(model))
    for a, b in zip(out[False][:3], out[True][:3]):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert_same_grads(out[False][3], out[True][3])
    assert out[False][2].max() > 0.1  # the KL term compared is not trivially zero


def test_the_teacher_distributions_and_the_critic_are_shared_alike(tokenizer):
    """The distillation teacher's whole distributions (response_log_softmax) and a critic's head outputs and their
    gradient: equal to a forward per row."""
    model = build_tiny_model(TinyModelConfig(**SMALL), tokenizer, 0).eval()
    prompt_ids, prompt_mask, response_ids, token_mask, loss_mask = batch(len(tokenizer), tokenizer.pad_token_id)
    inputs = (prompt_ids, prompt_mask, response_ids, token_mask)
    whole = response_log_softmax(model, *inputs, 1.0)
    torch.testing.assert_close(response_log_softmax(model, *inputs, 1.0, share=True) * token_mask[..., None],
                               whole * token_mask[..., None], rtol=1e-6, atol=1e-6)
    critic = ValueModel.from_causal_lm(model, CriticConfig()).eval()
    out = {}
    for share in (False, True):
        critic.zero_grad()
        head = response_head_outputs(critic, *inputs, share)  # [n, T, 1]
        ((head[..., 0] - 0.5) ** 2 * loss_mask).sum().backward()
        out[share] = head, grads(critic)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
    assert_same_grads(out[False][1], out[True][1])


def test_lora_adapters_and_a_model_that_scales_its_logits_share_alike(tokenizer):
    """LoRA (peft) adapters' gradient, and Granite (logits divided by logits_scaling after the head, so the
    whole-sequence pass): equal to a forward per row."""
    from omegaconf import OmegaConf
    from transformers import GraniteConfig, GraniteForCausalLM

    prompt_ids, prompt_mask, response_ids, token_mask, loss_mask = batch(100, 0)
    lora = OmegaConf.create({"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    torch.manual_seed(0)
    granite = GraniteForCausalLM(GraniteConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2, logits_scaling=8.0,
                                               pad_token_id=0)).eval()
    llama = build_tiny_model(TinyModelConfig(**SMALL), tokenizer, 0)
    adapted = with_lora(llama, lora).eval()
    for p in adapted.parameters():  # LoRA's B starts at zero: move it so that the adapters change the outputs
        if p.requires_grad:
            p.data.normal_(0, 0.1)
    prompt_l, _, response_l, _, _ = batch(len(tokenizer), tokenizer.pad_token_id)
    for model, ids in ((granite, (prompt_ids, response_ids)), (adapted, (prompt_l, response_l))):
        args = (ids[0], prompt_mask, ids[1], token_mask)
        out = {}
        for share in (False, True):
            model.zero_grad()
            logp, _, _ = response_outputs(model, *args, 1.0, share=share)
            (logp * loss_mask).sum().backward()
            out[share] = logp * token_mask, grads(model)
        torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-6, atol=1e-6)
        assert_same_grads(out[False][1], out[True][1])
    assert all("lora" in n for n in out[True][1])  # only the adapters train


def test_micro_batches_keep_a_groups_rows_side_by_side_within_the_token_budget():
    """With shared prompts the update packs whole groups (longest group first) and counts a micro-batch's token slots
    as its shared forward runs them: groups x (prompt + rows of the largest group x response)."""
    group_index = torch.tensor([0, 1, 0, 1, 2, 2])
    lengths = torch.tensor([8, 3, 2, 7, 1, 1])  # response tokens per row
    t = int(lengths.max())
    b = RolloutBatch(prompt_ids=torch.ones(6, 4, dtype=torch.long), prompt_mask=torch.ones(6, 4, dtype=torch.long),
                     response_ids=torch.ones(6, t, dtype=torch.long),
                     response_mask=(torch.arange(t) < lengths[:, None]).float(), truncated=torch.zeros(6, dtype=torch.bool),
                     group_index=group_index, answers=[""] * 6, texts=[""] * 6)
    hw = SimpleNamespace(micro_batch=4, max_tokens_per_micro_batch=None)
    learner = SimpleNamespace(cfg=SimpleNamespace(hw=hw), lockstep=False)
    parts = [p.tolist() for p in Learner.micro_batches(SimpleNamespace(**vars(learner), share=True), b)]
    assert parts == [[0, 2, 3, 1], [4, 5]]  # group 0 (longest row 8), then group 1 (7), then group 2
    assert [p.tolist() for p in Learner.micro_batches(SimpleNamespace(**vars(learner), share=False), b)] == [
        [0, 3, 1, 2], [4, 5]]  # longest rows first
    hw.max_tokens_per_micro_batch = 4 + 2 * 8  # one group of two rows of 8: the second group would need 2 x 20
    parts = [p.tolist() for p in Learner.micro_batches(SimpleNamespace(**vars(learner), share=True), b)]
    assert parts == [[0, 2], [3, 1], [4, 5]]


def test_the_start_up_check_shares_only_where_the_model_follows_the_block_mask(tokenizer):
    """On by default where exact: the learner shares prompts only if a shared forward of a short random batch gives
    the rows' own log-probs. A model whose forward drops the custom mask (as remote code building its own causal mask
    would) fails the check and runs a forward per row, as does an attention implementation that takes no custom mask,
    and hw.share_prompts=false."""
    from transformers import LlamaForCausalLM

    class DropsTheMask(LlamaForCausalLM):
        def forward(self, *args, attention_mask=None, **kwargs):
            return super().forward(*args, **kwargs)  # plain causal attention over whatever it is given

    model = build_tiny_model(TinyModelConfig(**SMALL), tokenizer, 0)
    share, note = prompt_sharing_for(model, True)
    assert share and note.startswith("each group's prompt once per micro-batch (sdpa attention"), note
    assert prompt_sharing_for(model, False) == (False, "a forward per row (hw.share_prompts=false)")
    dropping = DropsTheMask(model.config)
    dropping.load_state_dict(model.state_dict())
    share, note = prompt_sharing_for(dropping, True)
    assert not share and "differs from the model's own" in note, note
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision: measured against fp32, both layouts
        share, note = prompt_sharing_for(model, True)
        assert share and "from fp32)" in note, note
        share, note = prompt_sharing_for(dropping, True)
        assert not share and "nats from fp32" in note, note
    model.config._attn_implementation = "flash_attention_2"
    assert prompt_sharing_for(model, True) == (False, "a forward per row: flash_attention_2 attention takes no custom mask")
