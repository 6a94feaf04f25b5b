"""Sequence parallelism (hw.sp_size; rlcli/engine/sequence.py, docs/sequence_parallel.md): the sliced layout of a
micro-batch, and the models the Ulysses adapter covers. The updates over two ranks, equal to whole sequences' for
every algorithm, are compared in tests/test_train.py (test_sequence_parallel_over_two_ranks_...)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig

from rlcli.core.schema import ConfigError
from rlcli.engine.sequence import SequenceParallel
from rlcli.models.policy import slices


def test_each_response_token_is_predicted_by_the_state_before_it_in_the_sliced_layout():
    """Left-padded prompts of 3 and 1 real tokens, responses of 4 and 2 tokens (right-padded), and a multi-turn row
    whose observation token sits inside its response: laid out without padding between prompt and response, in
    slices of two ranks, the token after the state `at[i, j]` is response token j, for every real response token."""
    prompt_ids = torch.tensor([[0, 11, 12, 13], [0, 0, 0, 21], [31, 32, 33, 34]])  # [3, 4] left-padded
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]])
    response_ids = torch.tensor([[14, 15, 16, 17], [22, 23, 0, 0], [35, 36, 37, 0]])  # [3, 4] right-padded
    token_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])  # row 3's 36: an observation (real)
    parts = [slices(prompt_ids, prompt_mask, response_ids, token_mask, torch.device("cpu"), SimpleNamespace(size=2, rank=r))
             for r in (0, 1)]  # each rank's slices of the micro-batch, laid out in this process
    assert [p.inputs["input_ids"].shape for p in parts] == [torch.Size([3, 4])] * 2  # L = 7 real -> 8, in halves
    assert parts[1].inputs["position_ids"][0].tolist() == [4, 5, 6, 7] and parts[0].inputs["attention_mask"] is None
    whole_ids = torch.cat([p.inputs["input_ids"] for p in parts], 1)  # [3, 8]
    assert whole_ids.tolist() == [[11, 12, 13, 14, 15, 16, 17, 0], [21, 22, 23, 0, 0, 0, 0, 0],
                                  [31, 32, 33, 34, 35, 36, 37, 0]]
    whole_targets = torch.cat([p.targets for p in parts], 1)  # [3, 8]
    picked = whole_targets.gather(1, parts[0].at)  # [3, 4] the target of the state before each response token
    assert torch.equal(picked[token_mask.bool()], response_ids[token_mask.bool()])
    # pick: per-position outputs of each rank's slice, gathered, then read at the states before the response tokens
    parts[0].sp.gather = lambda x: torch.cat([x, parts[1].targets], 1)
    assert torch.equal(parts[0].pick(parts[0].targets)[token_mask.bool()], response_ids[token_mask.bool()])
    three = slices(prompt_ids, prompt_mask, response_ids, token_mask, torch.device("cpu"), SimpleNamespace(size=3, rank=2))
    assert three.inputs["input_ids"].shape == (3, 3) and three.inputs["position_ids"][0].tolist() == [6, 7, 8]


def checker(size):
    sp = object.__new__(SequenceParallel)  # the checks need no process group
    sp.size = size
    return sp


def model_of(config):
    config._attn_implementation = "sdpa"
    return SimpleNamespace(config=config)


@pytest.mark.parametrize("config,size,message", [
    (GPT2Config(n_head=4), 2, "model type 'gpt2' is not covered"),
    (MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=4096), 2, "'mistral' is not covered"),
    (LlamaConfig(hidden_size=384, num_attention_heads=6, num_key_value_heads=6), 4, "must divide the policy's 6 attention heads"),
    (LlamaConfig(num_attention_heads=8, num_key_value_heads=3), 2, "its 3 key-value heads"),
])  # fmt: skip
def test_a_model_the_adapter_does_not_cover_is_refused_in_one_line(config, size, message):
    with pytest.raises(ConfigError, match=message):
        checker(size).check(model_of(config), "policy")


def test_covered_models_pass_and_eager_attention_is_refused():
    checker(2).check(model_of(LlamaConfig(num_attention_heads=4, num_key_value_heads=2)), "policy")
    checker(4).check(model_of(LlamaConfig(num_attention_heads=8, num_key_value_heads=2)), "policy")  # kv replicated
    checker(2).check(model_of(MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
                     "teacher")
    eager = LlamaConfig(num_attention_heads=4, num_key_value_heads=4)
    eager._attn_implementation = "eager"
    with pytest.raises(ConfigError, match="the critic runs attention 'eager'"):
        checker(2).check(SimpleNamespace(config=eager), "critic")
