"""Rollout invariants: the distribution the loss trains is the one that sampled (left padding,
position ids, EOS masking included), and masks/truncation follow docs/design.md#masks."""

import pytest
import torch

from rlcli.models import response_logprobs
from rlcli.models.config import TinyModelConfig
from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer
from rlcli.rollout.hf import generate, response_mask_from_ids


def test_training_logprobs_equal_generate_sampling_scores():
    tok = load_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tok, seed=0).eval()
    prompts = ["Q: 313+897=?\nA:", "Q: 1+2=?\nA:", "Q: 45+6=?\nA:"]  # different lengths: left padding
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc["attention_mask"] == 0).any()
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=12, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         output_scores=True, return_dict_in_generate=True)
    resp = out.sequences[:, enc["input_ids"].shape[1]:]  # [3, T]
    sampled = torch.stack([s.log_softmax(-1) for s in out.scores], 1).gather(-1, resp[..., None]).squeeze(-1)
    mask, _ = response_mask_from_ids(resp, tok.eos_token_id)
    logp, _ = response_logprobs(model, enc["input_ids"], enc["attention_mask"], resp, mask, temperature=0.7)
    assert ((sampled - logp) * mask).abs().max().item() < 1e-4


def test_response_mask_includes_first_eos_and_flags_truncation():
    eos = 2
    ids = torch.tensor([[5, 6, 2, 0, 0], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    mask, truncated = response_mask_from_ids(ids, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_generate_returns_whole_groups():
    tok = load_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    b = generate(model, tok, ["Q: 1+1=?\nA:", "Q: 22+3=?\nA:"], ["2", "25"], n=3, max_new_tokens=6,
                 temperature=1.0, group_offset=10)
    assert b.group_index.tolist() == [10, 10, 10, 11, 11, 11] and b.answers == ["2"] * 3 + ["25"] * 3
    assert b.response_ids.shape[0] == 6 and (b.lengths <= 6).all()
    assert (b.truncated == (b.lengths == 6) & (b.response_ids[:, -1] != tok.eos_token_id)).all()


def test_a_groups_prompt_prefilled_once_samples_what_a_prefill_per_row_does(monkeypatch, tmp_path):
    """rollout.prefill_once: 3 prompts of different lengths (left padding) x 4 responses, 20 new tokens at
    temperature 1: the distinct prompts but their last token run once (3 rows of the prefill forward, not 12), and the
    same seed samples the same tokens with the sampler's log-probs equal to a prefill per row to 1e-5 (float32; the
    first token's logits come from a cached pass instead of the whole prompt's) and to the trainer's scoring. Rows
    that repeat no neighbour take no shared prefill, nor do caches of other kinds or collective generation."""
    import rlcli.rollout.hf as hf

    tok = load_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tok, seed=0).eval()
    prompts, answers = ["Q: 313+897=?\nA:", "Q: 1+2=?\nA:", "Q: 45+6=?\nA:"], ["1210", "3", "51"]
    prefills: list[int] = []
    shared = hf.shared_prefill
    monkeypatch.setattr(hf, "shared_prefill", lambda m, ids, mask: (prefills.append(ids.shape[0]), shared(m, ids, mask))[1])
    runs, widths = {}, {}  # the input positions of each forward: the prefill, then one per decoding step
    for once in (False, True):
        widths[once] = []
        hook = model.register_forward_pre_hook(lambda m, x, k, w=widths[once]: w.append(
            tuple(k.get("input_ids", x[0] if x else None).shape)), with_kwargs=True)
        torch.manual_seed(3)
        runs[once] = generate(model, tok, prompts, answers, n=4, max_new_tokens=20, temperature=1.0,
                              with_logprobs=True, prefill_once=once)
        hook.remove()
    a, b = runs[False], runs[True]
    width = a.prompt_ids.shape[1]
    assert widths[False][0] == (12, width) and widths[True][:2] == [(3, width - 1), (12, 1)]  # the cache is used
    assert prefills == [12] and torch.equal(a.response_ids, b.response_ids)
    mask = a.response_mask.bool()
    assert (a.rollout_logp - b.rollout_logp)[mask].abs().max() < 1e-5 and a.lengths.float().mean() > 5
    scored, _ = response_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.token_mask, temperature=1.0)
    assert (scored - b.rollout_logp)[mask].abs().max() < 1e-4
    ids, pm = b.prompt_ids, b.prompt_mask
    cache = shared(model, ids, pm)
    assert cache.get_seq_length() == ids.shape[1] - 1 and cache.layers[0].keys.shape[0] == 12
    assert shared(model, ids[::4], pm[::4]) is None  # one row per prompt: nothing to share
    # a cache that is not plain keys and values per layer (here sliding windows), or one the checkpoint asks for
    model.config.sliding_window, model.config.layer_types = 8, ["sliding_attention", "full_attention"] * 2
    assert shared(model, ids, pm) is None
    del model.config.sliding_window, model.config.layer_types
    model.generation_config.cache_implementation = "static"
    assert shared(model, ids, pm) is None
    model.generation_config.cache_implementation = None
    assert shared(model, ids, pm) is not None
    # where every forward is a collective (ZeRO-3 over ranks: synced_gpus) a rank whose rows repeat no prompt would
    # run one forward fewer than the others: no shared prefill there (a one-rank group here)
    ours = not torch.distributed.is_initialized()  # an earlier test of this worker may have made one already
    if ours:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert torch.distributed.get_world_size() == 1
        torch.manual_seed(3)
        synced = generate(model, tok, prompts, answers, n=4, max_new_tokens=20, temperature=1.0, synced_gpus=True,
                          prefill_once=True)
    finally:
        if ours:
            torch.distributed.destroy_process_group()
    assert prefills == [12] and torch.equal(synced.response_ids, a.response_ids)


def test_sampling_equals_scoring_for_a_checkpoint_whose_generation_config_changes_the_distribution(tmp_path):
    """An instruct checkpoint's generation_config (here repetition_penalty 1.3, no_repeat_ngram_size 2,
    top_k 5) must not reach the sampler: rlcli samples from exactly the distribution it scores. The
    sampler's own log-probs (`rollout_logp`, the processed scores generate sampled from) must equal the
    training log-probs of the saved checkpoint reloaded from disk. With the checkpoint's config in force
    they differ by far more than rounding (checked below), so this fails if it leaks back in."""
    from transformers import AutoModelForCausalLM

    tok = load_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 2
    model.generation_config.top_k = 5
    model.generation_config.do_sample = True
    model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert model.generation_config.repetition_penalty == 1.3  # the checkpoint carries it
    prompts = ["Q: 313+897=?\nA:", "Q: 1+2=?\nA:"]
    torch.manual_seed(0)
    b = generate(model, tok, prompts, ["1210", "3"], n=4, max_new_tokens=16, temperature=0.8, with_logprobs=True)
    logp, _ = response_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, b.response_mask, 0.8)
    gap = ((b.rollout_logp - logp) * b.response_mask).abs().max().item()
    assert gap < 1e-4, gap
    assert model.generation_config.repetition_penalty == 1.3  # restored after sampling
    # The checkpoint's own config does change the distribution (so the test above can fail).
    torch.manual_seed(0)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=16, do_sample=True, temperature=0.8, pad_token_id=tok.pad_token_id,
                         output_scores=True, return_dict_in_generate=True)
    resp = out.sequences[:, enc["input_ids"].shape[1]:]
    sampled = torch.stack([s.log_softmax(-1) for s in out.scores], 1).gather(-1, resp[..., None]).squeeze(-1)
    mask, _ = response_mask_from_ids(resp, tok.eos_token_id)
    scored, _ = response_logprobs(model, enc["input_ids"], enc["attention_mask"], resp, mask, 0.8)
    assert ((sampled - scored) * mask).abs().max().item() > 0.05


def test_recorded_sampler_logprobs_equal_generates_kept_scores_bitwise_without_keeping_them(monkeypatch):
    """rollout_logp is recorded one step at a time (SampledLogProbs after rlcli's own warpers) instead of
    generate(output_scores=True), which kept [b, V] scores per step (68 GiB on an H100 at 128 x 256 tokens x a
    151,936-token vocabulary). Tokens and log-probs must be bit-identical to transformers' own path with the same
    temperature, top-k and top-p in its config; and generate must not be asked to keep scores."""
    from transformers import GenerationMixin

    from rlcli.rollout.hf import sample_tokens

    tok = load_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tok, seed=0).eval()
    tok.padding_side = "left"
    enc = tok(["Q: 313+897=?\nA:", "Q: 1+2=?\nA:", "Q: 45+6=?\nA:"], return_tensors="pt", padding=True,
              add_special_tokens=False)
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (0.9, 7, 0.8)]:
        torch.manual_seed(0)
        out = model.generate(**enc, max_new_tokens=12, do_sample=True, temperature=temperature, top_k=top_k,
                             top_p=top_p, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             output_scores=True, return_dict_in_generate=True)
        resp = out.sequences[:, enc["input_ids"].shape[1]:]  # [3, T]
        kept = torch.stack([s.log_softmax(-1) for s in out.scores], 1).gather(-1, resp[..., None]).squeeze(-1)
        torch.manual_seed(0)
        ids, logp = sample_tokens(model, tok, enc["input_ids"], enc["attention_mask"], 12, temperature, top_p, top_k,
                                  batch_size=8, with_logprobs=True, synced_gpus=False)
        assert torch.equal(ids, resp) and torch.equal(logp, kept), (temperature, top_k, top_p)

    asked = []
    real = GenerationMixin.generate
    monkeypatch.setattr(GenerationMixin, "generate",
                        lambda self, *a, **k: asked.append(k["generation_config"].output_scores) or real(self, *a, **k))
    sample_tokens(model, tok, enc["input_ids"], enc["attention_mask"], 4, 1.0, 1.0, 0, 8, True, False)
    assert len(asked) == 1 and not asked[0]  # None: the default, False


def test_the_cpu_sampler_draws_torchs_own_tokens_from_its_random_stream(monkeypatch):
    """rlcli.rollout.hf.cpu_multinomial: inside the block, torch.multinomial(p, 1) on contiguous fp32 CPU probabilities
    is argmax(p / q) with q from exponential_draws (uniform doubles from torch.rand, log1p vectorised): torch's own
    numbers, tokens and generator state; near a midpoint between two fp32 numbers libm's rounding is kept; other
    layouts and bad probabilities go to torch (its errors); torch's function is back when the last block closes; HF
    generate samples through it the tokens it samples without it."""
    import math
    from contextlib import nullcontext

    from rlcli.rollout import hf

    original = torch.multinomial
    for seed, shape, chunk in ((0, (64, 4096), 2**18), (1, (3, 7), 2**18), (2, (50001,), 4096), (3, (9, 1000), 1000)):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        for _ in range(2):
            assert torch.equal(hf.exponential_draws(shape, g1, chunk), torch.empty(shape).exponential_(generator=g2))
        assert torch.equal(g1.get_state(), g2.get_state())

    # uniforms whose -log1p(-u) sits at a midpoint between two fp32 numbers: libm's double decides the rounding (on
    # this build torch's vectorised log1p alone rounds about 1 in 200 of them otherwise)
    torch.manual_seed(0)
    f = torch.rand(20000) * 20 + 1e-3
    u = -torch.expm1(-(f.double() + torch.nextafter(f, torch.tensor(math.inf)).double()) / 2)
    libm = torch.tensor([-math.log1p(-x) for x in u.tolist()], dtype=torch.float64).float()
    assert torch.equal(hf.exponential_of(u), libm)

    probs = torch.softmax(torch.randn(16, 5000) * 4, -1)
    probs[:4, 50:] = 0  # a top-k row
    with hf.cpu_multinomial(), hf.cpu_multinomial():  # nested: one patch
        fast = torch.multinomial
        assert fast is not original
        for seed in range(3):
            for p in (probs, probs[5], probs.t().contiguous().t()):  # rows, one row, another memory order
                g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
                assert torch.equal(fast(p, 1, generator=g1), original(p, 1, generator=g2))
                assert torch.equal(g1.get_state(), g2.get_state())
            torch.manual_seed(seed)
            a = fast(probs, 1, replacement=True)  # the default generator
            torch.manual_seed(seed)
            assert torch.equal(a, original(probs, 1, replacement=True))
        for bad, message in ((torch.tensor([[0.5, math.nan]]), "inf"), (torch.zeros(2, 3), "sum of probabilities")):
            with pytest.raises(RuntimeError, match=message):
                fast(bad, 1)
    assert torch.multinomial is original

    tok = load_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tok, seed=0).eval()
    ids, mask = hf.encode_prompts(tok, ["Q: 313+897=?\nA:", "Q: 1+2=?\nA:"], 4)
    drawn, draws = [], hf.exponential_draws
    monkeypatch.setattr(hf, "exponential_draws", lambda *a: drawn.append(a[0]) or draws(*a))
    runs = []
    for block in (hf.cpu_multinomial, nullcontext):
        monkeypatch.setattr(hf, "cpu_multinomial", block)
        torch.manual_seed(3)
        runs.append(hf.sample_tokens(model, tok, ids, mask, 10, 1.0, 1.0, 0, 8, False, False)[0])
        assert len(drawn) == runs[0].shape[1] and drawn[0] == (8, model.config.vocab_size)  # the first run's steps
        assert torch.multinomial is original
    assert torch.equal(*runs)


def test_chunked_logprobs_and_entropy_equal_the_whole_sequence_pass_with_their_gradients():
    """hw.logits_chunk: the vocabulary projection over 5 response positions at a time (recomputed in
    backward) gives the same log-probs, entropies (1e-6) and parameter gradients (1e-5 of each tensor's
    largest entry) as the whole-sequence pass, up to float32 summation order, with left-padded prompts
    and right-padded responses."""
    from rlcli.models import logits_chunk_for

    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(), load_tiny_tokenizer(), seed=0)
    assert logits_chunk_for(model, 5)[0] == 5  # the start-up check passes: the chunked pass is exact here
    n, tp, t = 3, 7, 23
    prompt_ids = torch.randint(5, 60, (n, tp))
    prompt_mask = torch.ones(n, tp, dtype=torch.long)
    prompt_mask[0, :3] = 0  # left padding
    response_ids = torch.randint(5, 60, (n, t))
    response_mask = torch.ones(n, t)
    response_mask[1, 15:] = 0  # right padding
    weights = torch.randn(n, t)
    out = {}
    for chunk in (0, 5):
        model.zero_grad()
        logp, ent = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, 0.7,
                                      with_entropy=True, entropy_grad=True, chunk=chunk)
        ((logp * weights).sum() + 0.1 * ent.sum()).backward()
        out[chunk] = (logp.detach(), ent.detach(), {k: p.grad.clone() for k, p in model.named_parameters()})
    (lp0, e0, g0), (lp5, e5, g5) = out[0], out[5]
    assert lp0.shape == (n, t) and torch.allclose(lp0, lp5, atol=1e-6) and torch.allclose(e0, e5, atol=1e-6)
    for k in g0:  # relative to each tensor's largest entry (the tied embedding sums over every position)
        assert (g0[k] - g5[k]).abs().max() <= 1e-5 * g0[k].abs().max(), k
    with torch.no_grad():  # the scoring pass (no autograd) takes the same path without checkpointing
        assert torch.allclose(response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, 0.7,
                                                chunk=5)[0], lp0, atol=1e-6)


def test_the_head_is_recomputed_in_the_backward_only_when_there_are_several_chunks():
    """The update's chunked pass checkpoints each chunk's head and log-softmax (recomputed in the backward pass) so that
    one chunk's [n, c, V] tensors live at a time; a single chunk would hold them at the backward's start either way, so
    it runs the head once. Counted with a forward hook on the head; the gradients equal the recomputing pass's."""
    from rlcli.models.policy import scaled

    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(), load_tiny_tokenizer(), seed=0)
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(5, 60, (2, 14))
    ones = torch.ones(2, 14, dtype=torch.long)
    grads = {}
    for chunk in (8, 4):  # the 8 response positions in one chunk, then in two
        calls.clear()
        model.zero_grad()
        logp, _ = response_logprobs(model, ids[:, :6], ones[:, :6], ids[:, 6:], ones[:, 6:].float(), 1.0, chunk=chunk)
        logp.sum().backward()
        grads[chunk] = {k: p.grad.clone() for k, p in model.named_parameters()}
        assert len(calls) == {8: 1, 4: 4}[chunk], chunk  # two chunks: each forward and again in the backward
    for k, g in grads[8].items():
        assert (g - grads[4][k]).abs().max() <= 1e-5 * g.abs().max(), k
    x = torch.randn(3, 5)
    assert scaled(x, 1.0) is x and torch.equal(scaled(x, 0.5), x / 0.5)  # no pass over the vocabulary at T = 1
    assert scaled(x.bfloat16(), 1.0).dtype == torch.float32


def test_the_chunk_check_refuses_a_model_that_scales_logits_after_the_head():
    """Granite divides its logits by `logits_scaling` after the output projection: the chunked pass (output
    embedding of the hidden states) would be off by far more than rounding (0.48 nats at scaling 8, and a
    gradient 7x off, issue 21). The start-up check falls back to the whole-sequence pass, which equals the
    model's own logits; a plain Llama keeps its chunk."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from rlcli.models import logits_chunk_for

    torch.manual_seed(0)
    granite = GraniteForCausalLM(GraniteConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2, logits_scaling=8.0))
    chunk, note = logits_chunk_for(granite, 256)
    assert chunk == 0 and "differ" in note, note
    ids = torch.randint(5, 100, (2, 12))
    ones = torch.ones_like(ids)
    logp, _ = response_logprobs(granite, ids[:, :4], ones[:, :4], ids[:, 4:], ones[:, 4:], 1.0, chunk=chunk)
    own = torch.log_softmax(granite(input_ids=ids).logits[:, 3:-1].float(), -1).gather(-1, ids[:, 4:, None])[..., 0]
    torch.testing.assert_close(logp, own, rtol=0, atol=1e-5)
    chunked, _ = response_logprobs(granite, ids[:, :4], ones[:, :4], ids[:, 4:], ones[:, 4:], 1.0, chunk=3)
    assert (chunked - own).abs().max() > 0.1  # what the check protects against


def test_zero3_generation_gathers_only_where_the_memory_plan_chose_it(monkeypatch):
    """The HF engine under ZeRO-3 over ranks gathers the whole model only for rollout.zero3_generation=gathered (the
    plan's choice, which it counts); left at auto (evaluation beside vLLM or rollout ranks, where the plan resolves
    nothing) it goes layer by layer, and outside ZeRO-3 over ranks there is nothing to gather."""
    from conftest import compose

    import rlcli.rollout.hf as hf

    tok = load_tiny_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tok, seed=0)
    for over_ranks in (True, False):
        monkeypatch.setattr(hf, "lockstep", lambda hw, over_ranks=over_ranks: over_ranks)
        chosen = {mode: hf.HFEngine(model, tok, "", compose(f"rollout.zero3_generation={mode}")).gather
                  for mode in ("auto", "gathered", "per_layer")}
        assert chosen == {"auto": False, "gathered": over_ranks, "per_layer": False}


def test_attention_under_cpu_autocast_runs_in_fp32_and_decoding_reads_the_cache_in_place(fp32_attention, monkeypatch):
    """rlcli.models.policy.fp32_attention_on_cpu (installed by rlcli.models.autocast on a CPU): under bf16 autocast
    every sdpa call gets fp32 q, k, v (autocast would cast them, the KV cache included, to bf16 at every call), and a
    decoding step (one query position) takes decode_attention: two matmuls over each key-value head's group of
    query heads, no flash call and no repeated copy of the cache. decode_attention equals sdpa over the repeated
    heads on hand-made inputs (a padded key, grouped heads, with and without a mask)."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlcli.models.policy import decode_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 8, generator=g), torch.randn(3, 2, 5, 8, generator=g), torch.randn(3, 2, 5, 8, generator=g)
    mask = torch.ones(3, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., :2] = False  # a left-padded row
    for m in (mask, None, mask[1:2]):  # a row's mask, a batch without padding, one mask broadcast over the rows
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=m,
                                              scale=0.3)  # [3, 4, 1, 8]
        got, none = decode_attention(q, k, v, m, 0.3)
        assert none is None and got.shape == (3, 1, 4, 8)
        assert (got - want.transpose(1, 2)).abs().max() < 1e-6
    wide = torch.randn(3, 2, 5, 12, generator=g)  # values wider than queries and keys (multi-head latent attention)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), wide.repeat_interleave(2, 1), attn_mask=mask)
    got, _ = decode_attention(q, k, wide, mask, None)  # scaling None: 1/sqrt(d) of the queries' 8
    assert got.shape == (3, 1, 4, 12) and (got - want.transpose(1, 2)).abs().max() < 1e-6

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in func.__name__:
                seen.append((func.__name__, args[0].dtype, args[0].shape[2]))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")).eval()
    ids = torch.randint(3, 100, (2, 7))
    am = torch.ones_like(ids)
    am[0, :2] = 0
    seen: list[tuple[str, torch.dtype, int]] = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), Ops():
        out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 11)
    assert [(dtype, length) for _, dtype, length in seen] == [(torch.float32, 7)] * 2  # the prefill only, in fp32
    seen.clear()
    with torch.no_grad(), Ops():  # no autocast: sdpa as it was, at every step
        model.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert [length for _, _, length in seen] == [7, 7, 1, 1, 1, 1, 1, 1]
    # Under Ulysses (an open sharding(): the wrapper sees one rank's slice of the positions) sdpa runs as it was
    import rlcli.engine.sequence as sequence

    monkeypatch.setattr(sequence, "_ACTIVE", object())
    seen.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), Ops():
        model.generate(input_ids=ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert [(dtype, length) for _, dtype, length in seen] == [(torch.bfloat16, n) for n in (7, 7, 1, 1, 1, 1, 1, 1)]
    # Each wrapper of the sdpa entry installs once, in either order: it carries the marks of those below it
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from rlcli.models.policy import fp32_attention_on_cpu

    top = ALL_ATTENTION_FUNCTIONS["sdpa"]  # fp32's, from the fixture
    sequence._wrap("sdpa")
    routed = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert routed is not top and routed.__wrapped__ is top
    fp32_attention_on_cpu.cache_clear()
    fp32_attention_on_cpu()
    sequence._wrap("sdpa")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is routed  # neither wrapped again
    ALL_ATTENTION_FUNCTIONS["sdpa"] = top.__wrapped__  # transformers' own: Ulysses first, then fp32 over it
    sequence._wrap("sdpa")
    fp32_attention_on_cpu.cache_clear()
    fp32_attention_on_cpu()
    over = ALL_ATTENTION_FUNCTIONS["sdpa"]
    sequence._wrap("sdpa")
    assert over.__wrapped__.__wrapped__ is top.__wrapped__ and ALL_ATTENTION_FUNCTIONS["sdpa"] is over
