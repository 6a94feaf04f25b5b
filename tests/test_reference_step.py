"""rlcli's learner against a GRPO step written from the papers in plain PyTorch, on the same rows (issue 57).

The rows are the hard case of a chat model whose pad token is its EOS token (SmolLM2, Qwen2.5): prompts hold real
EOS tokens (a chat template's end-of-turn) and are left-padded with the same id; responses end with an EOS at the
first, a middle or the last position, or run to the budget without one (truncated), and are right-padded with it.
The reference reads every row without any padding (its real prompt tokens, then its response up to and including the
first EOS), takes Shao et al.'s group advantage, the clipped token-level loss over the whole batch (DAPO), clips the
gradient norm at 1.0 and steps torch's AdamW. Two steps: Adam's first step moves every weight by about lr * sign(g),
which no gradient scale changes; the second sees the scale (the normalizer, the micro-batches, the clip).
"""

import pytest
import torch
from conftest import ROOT, compose

from rlcli.core.batch import RolloutBatch
from rlcli.rollout.hf import rollout_batch

P, G, T, LR = 2, 4, 6, 1e-3


@pytest.fixture(scope="module")
def pad_is_eos_model(tmp_path_factory):
    """A random 2-layer Llama with the embedded character tokenizer, padding with its EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlcli.models import load_tokenizer

    path = tmp_path_factory.mktemp("pad_is_eos")
    tok = load_tokenizer(str(ROOT / "rlcli" / "models" / "tokenizer"))
    tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), tok.eos_token_id


def rows(tokenizer, seed: int) -> RolloutBatch:
    """P prompts x G responses as every rollout engine hands them over (rlcli.rollout.hf.rollout_batch, from the
    generated tokens, padded after each row's end), with scores and the loss mask of the shaping stage."""
    eos = tokenizer.eos_token_id
    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, eos, 7, 8], [9, eos, 10]]  # real EOS tokens inside the prompts (a chat template's turn ends)
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts]).repeat_interleave(G, 0)  # [N, Tp]
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(G, 0)
    response_ids = torch.randint(11, 40, (P * G, T), generator=g)  # [N, T] no EOS among the sampled tokens
    for i, end in enumerate([1, 3, None, None, 6, 2, None, 4]):  # EOS at this length; None: truncated
        if end is not None:
            response_ids[i, end - 1 :] = eos  # the EOS, then padding with the same id
    batch = rollout_batch(tokenizer, prompt_ids, prompt_mask, response_ids, None, [""] * P, G, 0)
    return batch.replace(scores=torch.tensor([1.0, 0, 0, 1, 0, 1, 0, 0]), acc=torch.zeros(P * G),
                         loss_mask=batch.response_mask)


def reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: RolloutBatch, eos: int) -> float:
    """One GRPO step from the papers on unpadded rows. -> the gradient norm before clipping."""
    r = batch.scores.view(P, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()  # Shao et al. 2024, §4.1.2
    terms, n_tokens = [], 0
    for i in range(P * G):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]  # its real tokens, EOS ones included
        response = batch.response_ids[i].tolist()
        end = response.index(eos) + 1 if eos in response else len(response)  # up to and including the first EOS
        ids = torch.cat([prompt, torch.tensor(response[:end])])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # temperature 1
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())  # on-policy: 1, its gradient that of log pi
        terms.append(torch.max(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - 0.2, 1 + 0.28)).sum())
        n_tokens += end
    (torch.stack(terms).sum() / n_tokens).backward()  # token-level: one mean over the batch's tokens (DAPO)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    opt.zero_grad()
    return norm


def test_one_learner_update_equals_a_grpo_step_written_from_the_papers_with_pad_equal_to_eos(pad_is_eos_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlcli.algos.advantages import AdvantageInputs, compute_advantages, outcome_token_rewards
    from rlcli.config import validate
    from rlcli.core.units import units
    from rlcli.engine import init_distributed
    from rlcli.loop.learner import Learner, rl_phase

    path, eos = pad_is_eos_model
    cfg = compose("model=hf", f"model.path={path}", "algo.kl_coef=0", "algo.loss_agg=token_mean",
                  "algo.clip_high=0.28", f"optim.lr={LR}", f"rollout.prompts_per_step={P}", f"rollout.n={G}",
                  f"rollout.max_new_tokens={T}", "rollout.overlong_buffer_len=2", "hw.micro_batch=3", "hw.max_tokens_per_micro_batch=null", "hw.num_threads=1", run_dir=str(tmp_path))
    validate(cfg)
    init_distributed(cfg.hw)
    learner = Learner(cfg, path, units(cfg))
    assert learner.share  # the rows of a group share their prompt's forward: that path is the one compared
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.load_state_dict(learner.actor.module.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in (1, 2):
        assert learner.tokenizer.pad_token_id == eos
        batch = rows(learner.tokenizer, seed=step)
        assert batch.truncated.tolist() == [False, False, True, True, False, False, True, False]
        inp = AdvantageInputs(scores=batch.scores, token_rewards=outcome_token_rewards(batch.scores, batch.response_mask),
                              mask=batch.loss_mask, group_index=batch.group_index, lengths=batch.lengths, values=None,
                              step=step, total_steps=2)
        advantages, returns = compute_advantages(inp, cfg.algo)
        metrics = learner.update(batch.replace(advantages=advantages, returns=returns), rl_phase(cfg))
        norm = reference_step(ref, opt, batch, eos)
        assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert norm > 1.0  # the clip acts: its scale is part of what is compared
        for name, p in learner.actor.module.named_parameters():
            moved, expected = p.detach() - before[name], dict(ref.named_parameters())[name].detach() - before[name]
            torch.testing.assert_close(moved, expected, rtol=1e-3, atol=LR * 1e-3, msg=f"step {step}: {name}")
