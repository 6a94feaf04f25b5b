"""ALST's memory savings beside Ulysses (rlcli/engine/alst.py): the tiled MLP (hw.tiled_mlp) and the offloaded
gradient checkpoints (hw.offload_checkpoints) give the log-probs and gradients of the plain model, through the paths
they claim. Over two ranks (ZeRO-2 and ZeRO-3, with sequence parallelism) in tests/test_train.py
(test_long_sequence_savings_give_the_same_update)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig

from rlcli.core.schema import ConfigError
from rlcli.engine import alst
from rlcli.models import response_logprobs
from rlcli.models.policy import with_lora


def llama(checkpointing: bool = False, lora: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=100,
                                         tie_word_embeddings=True, attn_implementation="sdpa"))
    if checkpointing:
        model.gradient_checkpointing_enable()
    if lora:
        from omegaconf import OmegaConf

        model = with_lora(model, OmegaConf.create({"r": 4, "alpha": 8, "dropout": 0.0,
                                                    "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at 0, which leaves A without a gradient to compare
                torch.nn.init.normal_(p, std=0.1)
    return model.train()


def update(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs of a padded batch (3 rows, prompts of 5 and 3 real tokens, 37 response tokens) and the gradients of
    their sum: (logp [3, 37], {name: grad} of the trained parameters)."""
    g = torch.Generator().manual_seed(1)
    prompt_mask = torch.ones(3, 5, dtype=torch.long)
    prompt_mask[0, :2] = 0
    logp = response_logprobs(model, torch.randint(4, 100, (3, 5), generator=g), prompt_mask,
                             torch.randint(4, 100, (3, 37), generator=g), torch.ones(3, 37), 1.0, chunk=16)[0]
    logp.sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(a: tuple, b: tuple) -> None:
    assert (a[0] - b[0]).abs().max() <= 1e-6 and a[0].abs().max() > 1
    assert a[1].keys() == b[1].keys() and all(g.abs().max() > 0 for g in a[1].values())
    for n, g in a[1].items():
        assert (b[1][n] - g).abs().max() <= 1e-5 * g.abs().max(), n


@pytest.mark.parametrize("lora", [False, True])
def test_the_tiled_mlp_gives_the_plain_models_outputs_and_gradients_one_tile_at_a_time(lora, monkeypatch):
    """Tiles of 7 positions over 42-position rows: 6 tiles (the last one short) per MLP call, each run once in the
    forward and once in the backward's recompute; the log-probs and every trained gradient (LoRA's adapters, whose
    gradients DeepSpeed must hold until the last tile, too) equal the plain model's. Scoring (no autograd) keeps the
    model's own MLP."""
    base = update(llama(lora=lora))
    model = llama(lora=lora)
    calls: list[int] = []  # positions of each call of the MLP's own forward
    mlp = type(alst.decoder_layers(model)[0].mlp)
    plain = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda self, x: (calls.append(x.shape[-2]), plain(self, x))[1])
    asked: list[int] = []  # where every forward is a collective, the ranks agree on a tile count once per forward
    alst.tile_mlps(model, "policy", 7, agree=lambda k: (asked.append(k), k)[1])
    assert_same(base, update(model))
    # per layer 6 tiles of [3, 7] positions in the forward, then the backward's 6 over the flattened 3 x 42 (21 each)
    assert calls == [7] * 6 * 2 + [21] * 6 * 2 and asked == [6]
    update(model)
    assert asked == [6, 6]  # the next forward asks again
    calls.clear()
    with torch.no_grad():
        update_free = response_logprobs(model, torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                                        torch.ones(1, 20, dtype=torch.long), torch.ones(1, 20), 1.0)[0]
    assert update_free.shape == (1, 20) and calls == [22, 22]  # one whole call per layer


@pytest.mark.parametrize("lora", [False, True])
def test_offloaded_checkpoints_give_the_checkpointed_models_outputs_and_gradients(lora, monkeypatch):
    """model.gradient_checkpointing with hw.offload_checkpoints: every block runs through the offloading function
    (once per block in the forward), and the log-probs and gradients equal checkpointing's; under LoRA the first
    block's input (the frozen embeddings' output) needs no gradient, yet its adapters get theirs. With the tiled MLP
    inside the recompute too."""
    base = update(llama(checkpointing=True, lora=lora))
    apply = alst._OffloadedCheckpoint.apply
    for tiled in (False, True):
        model = llama(checkpointing=True, lora=lora)
        alst.offload_checkpoints(model, "policy")
        asked: list[int] = []
        if tiled:  # the recompute of each block reuses the forward's agreed tile count (9 tiles of 5 positions)
            alst.tile_mlps(model, "policy", 5, agree=lambda k, asked=asked: (asked.append(k), k)[1])
        kept: list[torch.Size] = []
        monkeypatch.setattr(alst._OffloadedCheckpoint, "apply",
                            lambda *a, kept=kept: (kept.append(a[1].shape), apply(*a))[1])
        assert_same(base, update(model))
        assert kept == [torch.Size([3, 42, 64])] * 2  # each block's input, once
        assert asked == ([9] if tiled else [])


def test_the_savings_refuse_what_they_cannot_run():
    """A mixture of experts (its MLP returns router outputs; by any of the config keys or an `experts` module), a model without blocks, offload without checkpoints, a
    model that drops out in training (the recomputes do not replay the random state)."""
    moe = LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, vocab_size=50))
    moe.config.num_local_experts = 4  # what Mixtral's config carries
    with pytest.raises(ConfigError, match="routes tokens to experts"):
        alst.tile_mlps(moe, "policy", None)
    assert MixtralConfig().num_local_experts == 8
    del moe.config.num_local_experts
    moe.config.n_routed_experts = 4  # DeepSeek-V2/V3's name for it
    with pytest.raises(ConfigError, match="routes tokens to experts"):
        alst.tile_mlps(moe, "policy", None)
    del moe.config.n_routed_experts
    moe.model.layers[0].mlp.experts = torch.nn.ModuleList()  # a sparse block whatever its config calls the count
    with pytest.raises(ConfigError, match="routes tokens to experts"):
        alst.tile_mlps(moe, "policy", None)
    with pytest.raises(ConfigError, match="no blocks with an `mlp`"):
        alst.tile_mlps(type("Head", (torch.nn.Module,), {"config": LlamaConfig(hidden_size=8, num_attention_heads=2)})(), "critic", None)
    with pytest.raises(ConfigError, match="model.gradient_checkpointing=true"):
        alst.offload_checkpoints(llama(), "policy")
    dropping = llama(checkpointing=True)
    dropping.config.attention_dropout = 0.1  # the recompute would draw other masks
    for save in (lambda m: alst.tile_mlps(m, "policy", None), lambda m: alst.offload_checkpoints(m, "policy")):
        with pytest.raises(ConfigError, match="drops out in training"):
            save(dropping)
