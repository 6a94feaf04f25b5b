"""The critic (rlcli/models/value.py): init from the policy, values at response positions, save/load,
the loss for each head, two-hot projection and the value augmentation (rlcli options,
docs/algorithms.md#rlcli-options).

Run: pytest -q tests/test_value.py (CPU, a few seconds). A 2-layer, 64-wide tiny Llama at random init
stands in for the policy; hand-computed numbers are derived in the comments.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from rlcli.algos.functional import value_loss
from rlcli.models import response_logprobs
from rlcli.models.config import HEADS, CriticConfig, TinyModelConfig, validate_critic
from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer
from rlcli.models.value import (
    HEAD_FILE,
    HEAD_JSON,
    ValueHeadSpec,
    ValueModel,
    augmented_values,
    critic_loss,
    explained_variance,
    load_critic,
    response_head_outputs,
    response_values,
    two_hot,
)

SMALL = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
PROMPTS = ["1+2=", "13+29=", "7+8=", "100+250="]
RESPONSES = ["3</s>", "42</s>", "15</s>", "350</s>"]


def cfg_for(head: str, **kw) -> CriticConfig:
    return CriticConfig(head=head, num_heads=3, num_bins=11, **kw)


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


@pytest.fixture(scope="module")
def policy(tok):
    return build_tiny_model(SMALL, tok, seed=3).eval()


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory, policy, tok):
    path = str(tmp_path_factory.mktemp("policy"))
    policy.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def encode(tok, prompts, responses, extra_left_pad=0):
    """Left-padded prompts [n, Tp] and right-padded responses [n, T], as the rollout produces them."""
    pad = tok.pad_token_id
    p = [tok(x, add_special_tokens=False)["input_ids"] for x in prompts]
    r = [tok(x, add_special_tokens=False)["input_ids"] for x in responses]
    tp = max(map(len, p)) + extra_left_pad
    t = max(map(len, r))
    prompt_ids = torch.tensor([[pad] * (tp - len(x)) + x for x in p])
    prompt_mask = torch.tensor([[0] * (tp - len(x)) + [1] * len(x) for x in p])
    response_ids = torch.tensor([x + [pad] * (t - len(x)) for x in r])
    response_mask = torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in r])
    return prompt_ids, prompt_mask, response_ids, response_mask


def randomise_head(critic: ValueModel, seed: int = 1) -> ValueModel:
    """Non-trivial head weights, so value tests do not pass merely because the head is zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in critic.head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return critic


# ---------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------


def test_config_is_a_documented_structured_config():
    from rlcli.schema_doc import field_docs

    node = OmegaConf.structured(CriticConfig)
    assert node.path is None and node.head == "scalar" and node.pretrain_steps == 50  # VAPO's 50 steps
    docs = field_docs(CriticConfig)
    assert set(docs) == set(CriticConfig.__dataclass_fields__), "every field needs a docstring"
    with pytest.raises(ValidationError):
        OmegaConf.merge(node, {"num_bins": "many"})  # typed: wrong type fails at compose time
    validate_critic(node)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"head": "quantile"}, "critic.head='quantile' must be one of: scalar, multi, distributional"),
        ({"v_min": 1.0, "v_max": 1.0}, "v_min"),
        ({"num_bins": 1}, "num_bins"),
        ({"pretrain_steps": 0}, "algo.value_pretrain=false turns value pretraining off"),
        ({"aug_w0": 1.5, "pretrain_steps": 5}, "aug_w0"),
    ],
)
def test_validate_critic_names_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        validate_critic(CriticConfig(**override))


# ---------------------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", HEADS)
def test_from_policy_path_copies_backbone_and_starts_at_zero(policy, policy_path, tok, head):
    critic = ValueModel.from_policy_path(policy_path, cfg_for(head))
    got, want = critic.backbone.state_dict(), policy.model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k  # bit-identical backbone
    assert critic.head.out_features == {"scalar": 1, "multi": 3, "distributional": 11}[head]
    with torch.no_grad():
        v = response_values(critic, *encode(tok, PROMPTS, RESPONSES))
    if head == "scalar":
        assert torch.equal(v, torch.zeros_like(v))
    else:
        # multi: centred head rows -> mean 0 up to rounding; distributional: uniform over a
        # symmetric support -> expectation 0 up to rounding.
        assert v.abs().max() < 1e-6
    if head == "multi":  # the heads must differ, or they would train as one scalar head
        h = response_head_outputs(critic, *encode(tok, PROMPTS, RESPONSES)).detach()
        assert h.std(-1).max() > 1e-3


def test_from_causal_lm_is_an_independent_copy(policy):
    critic = ValueModel.from_causal_lm(policy, CriticConfig())
    p = next(critic.backbone.parameters())
    assert torch.equal(p, next(policy.model.parameters()))
    assert p.data_ptr() != next(policy.model.parameters()).data_ptr()


# ---------------------------------------------------------------------------------------------------
# values at response positions
# ---------------------------------------------------------------------------------------------------


def test_response_values_shape_masking_and_position(policy_path, tok):
    critic = randomise_head(ValueModel.from_policy_path(policy_path, CriticConfig()))
    prompt_ids, prompt_mask, response_ids, response_mask = encode(tok, PROMPTS, RESPONSES)
    with torch.no_grad():
        v = response_values(critic, prompt_ids, prompt_mask, response_ids, response_mask)
    assert v.shape == response_ids.shape and v.dtype == torch.float32
    assert torch.equal(v[response_mask == 0], torch.zeros(int((response_mask == 0).sum())))
    assert (v[response_mask == 1] != 0).all()
    # Row i, token t: the critic run on the unpadded prompt + response, read at position len(prompt)-1+t.
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        ids = torch.tensor([tok(p + r, add_special_tokens=False)["input_ids"]])
        lp = len(tok(p, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            full = critic(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])  # [1, L]
        n_r = int(response_mask[i].sum())
        torch.testing.assert_close(v[i, :n_r], full[0, lp - 1 : lp - 1 + n_r], rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", HEADS)
def test_more_left_padding_changes_nothing(policy_path, tok, head):
    critic = randomise_head(ValueModel.from_policy_path(policy_path, cfg_for(head)))
    with torch.no_grad():
        v = response_values(critic, *encode(tok, PROMPTS, RESPONSES))
        v_pad = response_values(critic, *encode(tok, PROMPTS, RESPONSES, extra_left_pad=5))
    torch.testing.assert_close(v_pad, v, rtol=0, atol=1e-5)


def test_values_mirror_response_logprobs_slicing(policy, tok):
    """The critic built on the policy's backbone reads the same hidden states the policy's LM head
    reads: a head equal to a row of the LM head reproduces that vocabulary entry's logit."""
    critic = ValueModel.from_causal_lm(policy, CriticConfig())
    vocab_id = tok.convert_tokens_to_ids("5")
    with torch.no_grad():
        critic.head.weight.copy_(policy.lm_head.weight[vocab_id : vocab_id + 1])
    batch = encode(tok, PROMPTS, RESPONSES, extra_left_pad=2)
    prompt_ids, prompt_mask, _, response_mask = batch
    forced = torch.full_like(batch[2], vocab_id)  # score token "5" at every position
    with torch.no_grad():
        v = response_values(critic, prompt_ids, prompt_mask, forced, response_mask)
        logp, _ = response_logprobs(policy, prompt_ids, prompt_mask, forced, response_mask, 1.0)
        attn = torch.cat([prompt_mask, response_mask], 1)
        logits = policy(
            input_ids=torch.cat([prompt_ids, forced], 1), attention_mask=attn,
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        ).logits[:, prompt_ids.shape[1] - 1 : -1]  # [n, T, V]
    m = response_mask.bool()
    torch.testing.assert_close(v[m], logits[..., vocab_id][m], rtol=0, atol=1e-5)
    torch.testing.assert_close(logp[m], torch.log_softmax(logits, -1)[..., vocab_id][m], rtol=0, atol=1e-5)


def test_multi_head_value_is_the_mean_of_heads(policy_path, tok):
    critic = randomise_head(ValueModel.from_policy_path(policy_path, cfg_for("multi")))
    batch = encode(tok, PROMPTS, RESPONSES)
    with torch.no_grad():
        heads = response_head_outputs(critic, *batch)  # [n, T, 3]
        v = response_values(critic, *batch)
    assert heads.shape == (*v.shape, 3)
    m = batch[3].bool()
    torch.testing.assert_close(v[m], (heads[..., 0] + heads[..., 1] + heads[..., 2])[m] / 3, rtol=0, atol=1e-6)
    assert heads.std(-1)[m].min() > 0


def test_distributional_value_is_the_expectation(policy_path, tok):
    critic = randomise_head(ValueModel.from_policy_path(policy_path, cfg_for("distributional")))
    batch = encode(tok, PROMPTS, RESPONSES)
    ids = torch.cat([batch[0], batch[2]], 1)
    attn = torch.cat([batch[1], batch[3]], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = critic.logits(ids, attn, pos)  # [n, L, 11]
        v = critic(ids, attn, pos)  # [n, L]
    support = torch.linspace(-1, 1, 11)
    torch.testing.assert_close(v, (logits.softmax(-1) * support).sum(-1), rtol=0, atol=1e-6)
    scalar = ValueModel.from_policy_path(policy_path, CriticConfig())
    with pytest.raises(ValueError, match="distributional head only"):
        scalar.logits(ids, attn, pos)


# ---------------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", HEADS)
def test_save_load_round_trip(policy_path, tok, tmp_path, head):
    cfg = cfg_for(head)
    critic = randomise_head(ValueModel.from_policy_path(policy_path, cfg))
    out = str(tmp_path / "critic")
    critic.save_pretrained(out)
    critic.save_pretrained(out)  # overwriting an existing critic goes through the same rename
    assert sorted(os.listdir(tmp_path)) == ["critic"]  # no .tmp / .old left behind
    assert {HEAD_FILE, HEAD_JSON, "config.json", "model.safetensors"} <= set(os.listdir(out))
    loaded = ValueModel.from_pretrained(out, cfg)
    assert loaded.spec == critic.spec
    batch = encode(tok, PROMPTS, RESPONSES)
    with torch.no_grad():
        assert torch.equal(response_values(loaded, *batch), response_values(critic, *batch))
    assert load_critic(CriticConfig(**{**vars(cfg), "path": out}), policy_path).spec == critic.spec


def test_load_refuses_a_mismatched_head(policy_path, tmp_path):
    out = str(tmp_path / "critic")
    ValueModel.from_policy_path(policy_path, cfg_for("multi")).save_pretrained(out)
    with pytest.raises(ValueError, match="critic.head"):
        ValueModel.from_pretrained(out, cfg_for("scalar"))
    with pytest.raises(ValueError, match="not a saved rlcli critic"):
        ValueModel.from_pretrained(policy_path, cfg_for("scalar"))


def test_load_critic_sources(policy_path, policy):
    fresh = load_critic(CriticConfig(), policy_path)  # path null: the policy's backbone
    other = load_critic(CriticConfig(path=policy_path), "/nonexistent")  # any HF model: backbone, fresh head
    for c in (fresh, other):
        assert torch.equal(next(c.backbone.parameters()), next(policy.model.parameters()))
        assert torch.equal(c.head.weight, torch.zeros_like(c.head.weight))


# ---------------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------------


def test_two_hot_hand_computed():
    # support linspace(-1, 1, 5) = [-1, -0.5, 0, 0.5, 1], Δ = 0.5
    # 0.2: between 0 (bin 2) and 0.5 (bin 3): (0.5-0.2)/0.5 = 0.6 on bin 2, 0.2/0.5 = 0.4 on bin 3
    # -0.75: halfway between bins 0 and 1 ; 1.0: exactly the top atom ; 0.5: exactly bin 3
    # 3.0 and -7.0: clamped to the edges
    x = torch.tensor([0.2, -0.75, 1.0, 0.5, 3.0, -7.0])
    want = torch.tensor([
        [0, 0, 0.6, 0.4, 0],
        [0.5, 0.5, 0, 0, 0],
        [0, 0, 0, 0, 1],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1],
        [1, 0, 0, 0, 0],
    ])
    got = two_hot(x, -1.0, 1.0, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the expectation of the projection is the (clamped) input
    torch.testing.assert_close((got * torch.linspace(-1, 1, 5)).sum(-1), x.clamp(-1, 1), rtol=0, atol=1e-6)
    assert two_hot(torch.zeros(2, 3), -1.0, 1.0, 5).shape == (2, 3, 5)


def test_scalar_loss_is_functional_value_loss():
    v = torch.tensor([[0.2, -0.4, 0.9], [1.0, 0.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0], [0.1, 0.0, 0.0]])
    ret = torch.tensor([[1.0, 1.0, 1.0], [-1.0, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, m = critic_loss(v[..., None], old, ret, mask, ValueHeadSpec("scalar"), 0.5, num_tokens=8.0)
    ref, ref_m = value_loss(v, old, torch.nan_to_num(ret), mask, 0.5, 8.0)
    torch.testing.assert_close(loss, ref)
    assert set(m) == {"vf_loss", "vf_clipfrac", "explained_var", "values_mean"}
    for k in ref_m:
        torch.testing.assert_close(m[k], ref_m[k])


def test_multi_loss_is_the_mean_of_per_head_losses():
    heads = torch.tensor([[[0.1, 0.5], [0.9, -0.3]]])  # [1, 2, K=2]
    old = torch.zeros(1, 2)
    ret = torch.tensor([[1.0, 0.0]])
    mask = torch.ones(1, 2)
    loss, m = critic_loss(heads, old, ret, mask, ValueHeadSpec("multi", num_heads=2), 0.5, num_tokens=2.0)
    # head 0: V = [0.1, 0.9] -> clip(0.9, -0.5, 0.5) = 0.5: ½·max(0.81, 0.25) on t=0 = 0.405;
    #         t=1: ½·max(0.81, 0.25) = 0.405 -> sum 0.81 / 2 tokens = 0.405
    # head 1: V = [0.5, -0.3] -> t=0: ½·0.25 = 0.125; t=1: ½·0.09 = 0.045 -> 0.17 / 2 = 0.085
    # mean over heads: (0.405 + 0.085) / 2 = 0.245
    torch.testing.assert_close(loss, torch.tensor(0.245), rtol=0, atol=1e-6)
    # head 0 t=1: clipped 0.5 -> (0.5-0)^2 = 0.25 < 0.81 -> not clipped. No clipping anywhere.
    assert m["vf_clipfrac"] == 0
    torch.testing.assert_close(m["values_mean"], torch.tensor((0.3 + 0.3) / 2), rtol=0, atol=1e-6)
    # spread of the heads: |0.1-0.5|/2 = 0.2, |0.9+0.3|/2 = 0.6 -> mean 0.4
    torch.testing.assert_close(m["vf_head_std"], torch.tensor(0.4), rtol=0, atol=1e-6)


def test_distributional_loss_hand_computed():
    spec = ValueHeadSpec("distributional", num_bins=3, v_min=-1.0, v_max=1.0)  # atoms -1, 0, 1
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, math.log(2.0), math.log(3.0)]]])  # [1, 2, 3]
    ret = torch.tensor([[0.5, 2.0]])  # 0.5 -> (0, ½, ½); 2.0 clamped -> (0, 0, 1)
    mask = torch.ones(1, 2)
    loss, m = critic_loss(logits, torch.zeros(1, 2), ret, mask, spec, clip_range=0.5, num_tokens=4.0)
    # t=0: uniform -> CE = log 3.  t=1: p = (1, 2, 3)/6 -> CE = -log(3/6) = log 2.  Sum / 4 tokens.
    torch.testing.assert_close(loss, torch.tensor((math.log(3) + math.log(2)) / 4), rtol=0, atol=1e-6)
    assert m["vf_clipfrac"] == 0
    torch.testing.assert_close(m["vf_return_clamped"], torch.tensor(0.5))
    # values: t=0 uniform -> 0; t=1 -> (-1·1 + 0·2 + 1·3)/6 = 1/3
    torch.testing.assert_close(m["values_mean"], torch.tensor(1 / 6), rtol=0, atol=1e-6)


@pytest.mark.parametrize("head", HEADS)
def test_micro_batches_with_global_normalizer_equal_one_batch(policy_path, tok, head):
    cfg = cfg_for(head)
    critic = randomise_head(ValueModel.from_policy_path(policy_path, cfg))
    batch = encode(tok, PROMPTS, RESPONSES)
    mask = batch[3]
    returns = torch.tensor([1.0, -1.0, 1.0, 0.0])[:, None] * mask
    old = torch.zeros_like(returns)

    def grads(rows_list):
        critic.zero_grad()
        n_tok = float(mask.sum())
        for rows in rows_list:
            part = [x[rows] for x in batch]
            head_out = response_head_outputs(critic, *part)
            loss, _ = critic_loss(head_out, old[rows], returns[rows], mask[rows], critic.spec, 0.5, n_tok)
            loss.backward()
        return [p.grad.clone() for p in critic.parameters()]

    whole = grads([torch.arange(4)])
    split = grads([torch.tensor([0]), torch.tensor([1, 2]), torch.tensor([3])])
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("head", HEADS)
def test_a_few_steps_reduce_the_loss_and_raise_explained_variance(policy_path, tok, head):
    torch.manual_seed(0)
    critic = ValueModel.from_policy_path(policy_path, cfg_for(head))
    batch = encode(tok, PROMPTS, RESPONSES)
    mask = batch[3]
    # Fixed Monte-Carlo returns (γ = λ = 1, outcome reward on the last token): constant per row.
    returns = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask
    # lr 3e-3: the zero-initialised distributional head needs logit gaps of several units, which at
    # 1e-3 take ~4x longer (15 steps: EV 0.31 vs 0.88 for the scalar head); 3e-3 fits all three.
    opt = torch.optim.AdamW(critic.parameters(), lr=3e-3)
    losses, evs = [], []
    for _ in range(15):
        head_out = response_head_outputs(critic, *batch)
        values = critic.spec.reduce(head_out).detach()
        # Each step plays a fresh stage 4: old values = the current critic's, so ε_v never stalls it.
        loss, m = critic_loss(head_out, values, returns, mask, critic.spec, 0.5, float(mask.sum()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        evs.append(m["explained_var"].item())
    # The distributional loss is a cross-entropy: its floor is the entropy of the two-hot targets
    # (0.5 falls halfway between atoms 0.4 and 0.6 -> log 2 on those tokens); the excess must halve.
    floor = 0.0
    if head == "distributional":
        target = two_hot(returns, -1.0, 1.0, 11)
        entropy = -(target * target.clamp_min(1e-12).log()).sum(-1)
        floor = (entropy * mask).sum().item() / mask.sum().item()
    assert losses[-1] - floor < 0.5 * (losses[0] - floor), (floor, losses)
    assert evs[0] < 0.05 and evs[-1] > 0.5, evs
    with torch.no_grad():
        ev = explained_variance(response_values(critic, *batch), returns, mask)
    assert ev > 0.5


# ---------------------------------------------------------------------------------------------------
# augmentation
# ---------------------------------------------------------------------------------------------------


def test_augmented_values_hand_computed():
    v_c = torch.tensor([[1.0, 0.0]])
    v_p = torch.tensor([[0.0, 2.0]])
    # t = 0: w = w0 = 0.8 -> 0.8·V_pre + 0.2·V_critic = [0.2, 1.6]
    torch.testing.assert_close(augmented_values(v_c, v_p, 0, 100, 0.8, 5.0), torch.tensor([[0.2, 1.6]]))
    # t = T: w = 0.8·e^-5 = 0.00539036 -> [1 - w, 2w] = [0.99460964, 0.01078072]
    w = 0.8 * math.exp(-5.0)
    got = augmented_values(v_c, v_p, 100, 100, 0.8, 5.0)
    torch.testing.assert_close(got, torch.tensor([[1 - w, 2 * w]]), rtol=0, atol=1e-7)
    assert abs(w - 0.00539036) < 1e-8


def test_gradient_checkpointing_leaves_policy_and_critic_gradients_unchanged():
    """model.gradient_checkpointing recomputes activations in backward: the same gradients (1e-5 of each
    tensor's largest entry) for the policy's log-probs and the critic's values."""
    from rlcli.models import response_logprobs
    from rlcli.models.config import TinyModelConfig
    from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer
    from rlcli.models.value import ValueHeadSpec, ValueModel, response_values

    torch.manual_seed(0)
    ids, mask = torch.randint(5, 60, (3, 6)), torch.ones(3, 6, dtype=torch.long)
    resp, rmask = torch.randint(5, 60, (3, 9)), torch.ones(3, 9)
    policy = build_tiny_model(TinyModelConfig(), load_tiny_tokenizer(), seed=0).train()
    critic = ValueModel(build_tiny_model(TinyModelConfig(), load_tiny_tokenizer(), seed=1).model, ValueHeadSpec(),
                        torch.nn.Linear(256, 1)).train()
    grads = {}
    for ckpt in (False, True):
        if ckpt:
            policy.gradient_checkpointing_enable()
            critic.gradient_checkpointing_enable()
        policy.zero_grad()
        critic.zero_grad()
        response_logprobs(policy, ids, mask, resp, rmask, 1.0)[0].sum().backward()
        response_values(critic, ids, mask, resp, rmask).sum().backward()
        grads[ckpt] = {k: p.grad.clone() for m in (policy, critic) for k, p in m.named_parameters() if p.grad is not None}
    assert policy.is_gradient_checkpointing and critic.backbone.is_gradient_checkpointing and len(grads[True]) == len(grads[False]) > 20
    for k, g in grads[False].items():
        assert (grads[True][k] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-12, k
