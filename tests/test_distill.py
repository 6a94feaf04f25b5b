"""On-policy distillation (distill.*, algo=distill): the per-token advantage by hand, a teacher equal to the student
changing nothing bit for bit, a different one drawing the student toward it, the teacher's tokenizer checked before
any weights load."""

import copy
import json
import shutil
import time

import pytest
import torch
from conftest import FAST, compose, metric_rows, policy_tensors, rlcli, stable

STUDENT = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -0.4, -0.6, -0.8]])  # [2, 4] log π_student(y_t)
TEACHER = torch.tensor([[-1.5, -1.0, -0.5, -3.0], [-0.3, -0.1, -0.9, -0.6]])  # [2, 4] log π_teacher(y_t)
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])  # row 0: padding at the end; row 1: an observation at t = 1


@pytest.mark.parametrize("discount, want", [
    # r = teacher - student on the mask: row 0 [-0.5, 1.0, 0.0, 0], row 1 [-0.1, 0, -0.3, 0.2]; coef 2.
    (0.0, [[-1.0, 2.0, 0.0, 0.0], [-0.2, 0.0, -0.6, 0.4]]),
    # γ = 0.5 over mask tokens. Row 0: A2 = 0, A1 = 1 + 0.5*0 = 1, A0 = -0.5 + 0.5*1 = 0. Row 1 (t = 1 is skipped,
    # neither paying nor discounting): A3 = 0.2, A2 = -0.3 + 0.5*0.2 = -0.2, A0 = -0.1 + 0.5*(-0.2) = -0.2.
    (0.5, [[0.0, 2.0, 0.0, 0.0], [-0.4, 0.0, -0.4, 0.4]]),
])
def test_distill_advantages_by_hand(discount, want):
    from rlcli.algos.functional import distill_advantages

    got = distill_advantages(STUDENT, TEACHER, MASK, 2.0, discount)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6), got
    assert (got[MASK == 0] == 0).all()


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_changes_nothing_bit_for_bit(make_trainer):
    """distill.teacher = the student's own weights: the teacher's log-probs equal the student's bitwise, so the
    distillation advantage is exactly 0 and the step (metrics and every weight after it) is bit-identical to the
    same step without a teacher, in fp32."""
    plain = make_trainer("save=false", run="plain")
    same = make_trainer("save=false", f"distill.teacher={plain.model_path}", run="teacher")
    a, b = plain.train_step(1), same.train_step(1)
    assert b["distill/reverse_kl"] == 0.0 and b["distill/teacher_logp"] < 0 and 0 <= b["distill/unlikely_frac"] <= 1
    keys = [k for k in a if not k.startswith(("timing_s/", "perf/"))]
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    for (n, p), q in zip(plain.learner.actor.module.named_parameters(), same.learner.actor.module.parameters()):
        assert torch.equal(p, q), n
    assert all(not p.requires_grad for p in same.learner.teacher.parameters()) and not same.learner.teacher.training
    from rlcli.loop.summary import startup_summary

    assert f"distillation   teacher {plain.model_path}, coef 1.0" in startup_summary(same)
    assert "distillation   none" in startup_summary(plain)


def reverse_kl(student, teacher, batch, temperature: float) -> float:
    """KL(π_student ‖ π_teacher) over the whole vocabulary at each loss-mask position of `batch`'s responses (the
    sampled tokens held fixed), the mean per token."""
    from rlcli.models import response_log_softmax

    inputs = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.token_mask, temperature)
    s, t = response_log_softmax(student, *inputs), response_log_softmax(teacher, *inputs)  # [N, T, V]
    kl = (s.exp() * (s - t)).sum(-1)  # [N, T]
    mask = batch.loss_mask.float()  # [N, T]
    return float((kl * mask).sum() / mask.sum())


@pytest.mark.slow
def test_distillation_steps_move_the_student_toward_the_teacher(make_trainer, tmp_path, monkeypatch):
    """algo=distill with a fixed teacher (a tiny model of another shape and seed): six steps bring the student's
    reverse KL to the teacher, over the whole vocabulary on step 1's sampled responses, below 0.7 of what it was
    before step 1. Measured: 0.060 -> 0.026 (0.43 of it) at seed 0, 0.43-0.54 at seeds 0-3; the first step
    (Adam moves every weight by about lr, on a 16-response estimate) raises it, the next five lower it. A loop
    that hands distill_advantages the student and the teacher swapped pays the student for moving away: 0.060 ->
    2.46."""
    t = make_trainer("save=false", "algo=distill", f"distill.teacher={small_teacher(tmp_path / 'teacher')}")
    initial = copy.deepcopy(t.learner.actor.module)
    batches = []
    advantage = t.advantage

    def keep(batch, *args):
        batches.append(batch)
        return advantage(batch, *args)

    monkeypatch.setattr(t, "advantage", keep)
    for step in range(1, 7):
        t.train_step(step)
    first, temperature = batches[0], t.cfg.rollout.temperature
    before = reverse_kl(initial.eval(), t.learner.teacher, first, temperature)
    after = reverse_kl(t.learner.actor.module.eval(), t.learner.teacher, first, temperature)
    assert before > 0.03 and after < 0.7 * before, (before, after)


def test_a_teacher_with_another_tokenizer_is_refused_before_any_weights_load(tmp_path):
    """The tiny student's tokenizer with two token ids swapped: refused, naming the key and the fix, in under 2 s."""
    from rlcli.core.schema import ConfigError
    from rlcli.models.checks import check_teacher
    from rlcli.models.tiny import TOKENIZER_DIR

    teacher = tmp_path / "teacher"
    shutil.copytree(TOKENIZER_DIR, teacher)
    spec = json.loads((teacher / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    x, y = sorted(vocab, key=vocab.get)[-2:]
    vocab[x], vocab[y] = vocab[y], vocab[x]
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    (teacher / "config.json").write_text("{}")
    cfg = compose(*FAST, f"distill.teacher={teacher}", run_dir="/tmp/unused")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"distill.teacher=.*another tokenizer.* 2 of the student's tokens"):
        check_teacher(cfg)
    assert time.perf_counter() - t0 < 2.0
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", teacher / "tokenizer.json")
    check_teacher(cfg)  # the same tokenizer passes


def test_algo_distill_needs_a_teacher():
    from rlcli.config import validate
    from rlcli.core.schema import ConfigError

    with pytest.raises(ConfigError, match=r"algo=distill .* set distill.teacher="):
        validate(compose(*FAST, "algo=distill", run_dir="/tmp/unused"))


def test_full_vocabulary_reverse_kl_equals_the_direct_sum_and_its_gradient_passes_finite_differences():
    from rlcli.algos.functional import reverse_kl_full

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)  # [n, T, V], temperature-scaled
    other = torch.log_softmax(torch.randn(2, 3, 7, generator=g, dtype=torch.float64), -1)
    p = torch.softmax(logits, -1)
    direct = torch.stack([torch.stack([sum(p[i, t, v] * (torch.log(p[i, t, v]) - other[i, t, v]) for v in range(7))
                                       for t in range(3)]) for i in range(2)])
    assert torch.allclose(reverse_kl_full(logits, other).double(), direct, atol=1e-6)
    assert (reverse_kl_full(logits, other) >= 0).all() and reverse_kl_full(other, other).abs().max() < 1e-6
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: (torch.log_softmax(z, -1).exp() * (torch.log_softmax(z, -1) - other))
                                    .sum(-1), (x,), eps=1e-6, atol=1e-5)
    # rlcli's function (fp32 inside) against finite differences of itself in float64 on a random direction
    u = torch.randn_like(logits)
    f = lambda z: reverse_kl_full(z, other).sum().double()  # noqa: E731
    x = logits.float().clone().requires_grad_(True)
    f(x).backward()
    fd = (f((logits + 1e-3 * u).float()) - f((logits - 1e-3 * u).float())) / 2e-3
    assert abs(float((x.grad.double() * u).sum()) - float(fd)) < 1e-3


@pytest.mark.parametrize("chunk", [0, 3])
def test_the_update_pass_gives_the_full_kl_of_the_models_own_logits(chunk):
    """response_outputs' kl (whole sequence and chunked) equals KL computed from the student's and the teacher's own
    logits to 1e-6, in the same pass as the log-probs (which are unchanged by asking for it)."""
    from rlcli.models import response_log_softmax, response_logprobs, response_outputs
    from rlcli.models.config import TinyModelConfig
    from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer

    tiny = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    student, teacher = (build_tiny_model(tiny, load_tiny_tokenizer(), seed=s).eval() for s in (0, 1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (3, 9), generator=g)
    ones = torch.ones_like(ids)
    args = (ids[:, :4], ones[:, :4], ids[:, 4:], ones[:, 4:], 0.7)
    t_logp = response_log_softmax(teacher, *args)  # [3, 5, V]
    logp, _, kl = response_outputs(student, *args, chunk=chunk, kl_to=t_logp)
    with torch.no_grad():
        s_logp = torch.log_softmax(student(input_ids=ids).logits[:, 3:-1].float() / 0.7, -1)  # [3, 5, V]
    direct = (s_logp.exp() * (s_logp - t_logp)).sum(-1)
    assert torch.allclose(kl, direct, atol=1e-6) and kl.requires_grad
    assert torch.equal(logp, response_logprobs(student, *args, chunk=chunk)[0])


@pytest.mark.slow
def test_full_kl_term_trains_and_is_logged(make_trainer):
    """distill.full_kl_coef > 0 with algo=distill: a step whose loss holds the full-vocabulary KL to a different
    teacher (the random-init tiny model of another seed) logs distill/full_kl > 0 and moves the weights."""
    plain = make_trainer("save=false", run="plain")
    t = make_trainer("save=false", "algo=distill", "distill.coef=0", "distill.full_kl_coef=1.0",
                     f"distill.teacher={plain.model_path}", "model.warm_start.seed=1", run="student")
    before = [p.detach().clone() for p in t.learner.actor.module.parameters()]
    m = t.train_step(1)
    assert m["distill/full_kl"] > 0 and m["distill/reverse_kl"] != 0
    assert any(not torch.equal(a, p) for a, p in zip(before, t.learner.actor.module.parameters()))


def test_the_memory_plan_counts_the_teacher(tmp_path):
    """The teacher's weights (its own config.json's shape, the student's bytes per weight), divided over the ranks at
    ZeRO-3; the teacher's whole log-probs in the update with distill.full_kl_coef."""
    from types import SimpleNamespace

    from rlcli.plan.estimate import estimate
    from rlcli.plan.shapes import arch_of, param_count

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100,
             "num_attention_heads": 4, "tie_word_embeddings": True}
    (teacher / "config.json").write_text(json.dumps(shape))
    psi = param_count(arch_of(SimpleNamespace(path=str(teacher), gguf_file=None)))
    plan = estimate(compose(f"distill.teacher={teacher}", run_dir="/tmp/unused"))
    assert plan.rows["teacher"] == psi * 4 and "teacher log-probs" not in plan.rows
    plan = estimate(compose(f"distill.teacher={teacher}", "distill.full_kl_coef=1", "hw=cpu_x2", "hw.zero_stage=3",
                            run_dir="/tmp/unused"))
    assert plan.rows["teacher"] == psi * 4 / 2
    mb = plan.shape["micro_rows"]
    assert plan.rows["teacher log-probs"] == mb * 48 * 100 * 4


@pytest.mark.slow
def test_a_lora_student_is_scored_with_its_adapters(make_trainer):
    """A LoRA student of its own base as the teacher: peft's adapters start as an exact no-op (B = 0), so the
    adapted student's log-probs equal the teacher's and the reverse KL is exactly 0; after one update they differ."""
    plain = make_trainer("save=false", run="plain")
    t = make_trainer("save=false", "model.lora.r=4", "optim.lr=1e-2", f"distill.teacher={plain.model_path}",
                     run="lora")
    assert t.train_step(1)["distill/reverse_kl"] == 0.0
    assert t.train_step(2)["distill/reverse_kl"] != 0.0


def small_teacher(directory):
    """A tiny model of its own shape (only the tokenizer must match the student's), saved to `directory`."""
    from rlcli.models.config import TinyModelConfig
    from rlcli.models.tiny import build_tiny_model, load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok,
                     seed=3).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_a_teacher_partitioned_under_zero3_scores_as_a_whole_one(make_trainer, tmp_path):
    """hw.zero_stage=3: the teacher is built partitioned and wrapped by DeepSpeed without an optimizer
    (rlcli.engine.frozen_model); its scores, the distillation metrics and the step equal ZeRO-0's (1e-5: summation
    order)."""
    teacher = small_teacher(tmp_path / "teacher")
    z0 = make_trainer("save=false", f"distill.teacher={teacher}", run="z0")
    z3 = make_trainer("save=false", f"distill.teacher={teacher}", "hw.zero_stage=3", run="z3")
    assert any(hasattr(p, "ds_id") for p in z3.learner.teacher.parameters())  # partitioned
    a, b = z0.train_step(1), z3.train_step(1)
    for k in ("distill/reverse_kl", "distill/teacher_logp", "distill/unlikely_frac", "actor/pg_loss", "actor/grad_norm",
              "adv/mean"):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k


@pytest.mark.slow
def test_a_resumed_distillation_run_equals_the_straight_one(tmp_path):
    """`rlcli train` with a teacher of its own shape, checkpointed after step 1 and resumed from it: step 2's metrics
    (distill/* included) and the saved policy are bit-identical to the straight run's. The teacher holds no state:
    the resumed run loads it again."""
    teacher = small_teacher(tmp_path / "teacher")
    args = [*FAST, "steps=2", "eval.before=false", f"distill.teacher={teacher}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    rlcli(tmp_path, "train", "checkpoint.every=1", f"hydra.run.dir={straight}", *args)
    steps = [r for r in stable(metric_rows(straight)) if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["distill/reverse_kl"] != 0 for r in steps)
    out = rlcli(tmp_path, "train", f"resume={straight / 'checkpoints' / 'step_1'}", f"hydra.run.dir={resumed}", *args)
    assert "1 of 2 steps done" in out.stdout
    assert [r for r in stable(metric_rows(resumed)) if "actor/pg_loss" in r] == steps  # step 1 from the checkpoint
    a, b = policy_tensors(straight), policy_tensors(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_asynchronous_rollout_distills_on_the_training_rank_as_the_synchronous_run(tmp_path):
    """One training rank and one rollout rank at rollout.async.max_staleness=0: the teacher is loaded and scores on
    the training rank (the rollout rank only generates); every metric, distill/* included, equals the synchronous
    run's bit for bit (test_async's check), and the teacher's signal is not zero."""
    from test_async import same_training

    args = [*FAST, "steps=2", "eval.before=false", "checkpoint.every=0", "hw=cpu_x2",
            f"distill.teacher={small_teacher(tmp_path / 'teacher')}"]
    rlcli(tmp_path, "train", *args, "hw.nproc=1", f"hydra.run.dir={tmp_path / 'sync'}")
    rlcli(tmp_path, "train", *args, "rollout.async.max_staleness=0", f"hydra.run.dir={tmp_path / 'async'}")
    assert same_training(tmp_path / "sync", tmp_path / "async")
    steps = [r for r in metric_rows(tmp_path / "async") if "distill/reverse_kl" in r]
    assert len(steps) == 2 and all(r["distill/reverse_kl"] != 0 for r in steps)


@pytest.mark.slow
def test_a_vllm_rollout_distills_as_the_teacher_scores_on_the_trainer(make_trainer, tmp_path):
    """rollout.engine=vllm: the student samples with vLLM and the teacher scores the sampled tokens in the trainer's
    scoring stage, against the trainer's own log-probs (not the sampler's): a teacher equal to the student gives a
    reverse KL of exactly 0; a different teacher gives a finite, nonzero one."""
    plain = make_trainer("save=false", run="plain")
    same = make_trainer("save=false", "rollout.engine=vllm", f"distill.teacher={plain.model_path}", run="same")
    other = make_trainer("save=false", "rollout.engine=vllm", f"distill.teacher={small_teacher(tmp_path / 't')}",
                         run="other")
    a, b = same.train_step(1), other.train_step(1)
    assert a["distill/reverse_kl"] == 0.0 and a["rollout_corr/kl"] >= 0  # the sampler's gap is not the teacher's
    assert b["distill/reverse_kl"] != 0.0 and all(map(torch.isfinite, map(torch.tensor, b.values())))


# ------------------------------------------------------------------------------------------------ self-distillation


def test_the_privileged_prompt_keeps_the_prompts_tokens_and_encodes_only_the_text_around_them():
    """distill.teacher=self: each prompt's own tokens inside the text of distill.privileged, the row's answer filled
    in, left-padded again; the responses untouched."""
    from rlcli.core.batch import RolloutBatch
    from rlcli.loop.learner import privileged_batch
    from rlcli.models.tiny import load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    p0, p1 = enc("Q: 1+2=?"), enc("Q: 10+20=?")
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (len(p1) - len(p0)) + p0, p1])  # [2, Tp] left-padded
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[len(p1) - len(p0)], [0]])).long()  # [2, Tp]
    b = RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=torch.tensor([[5, 6], [7, 0]]),
                     response_mask=torch.tensor([[1, 1], [1, 0]]), truncated=torch.zeros(2, dtype=torch.bool),
                     group_index=torch.tensor([0, 1]), answers=["3", "30"], texts=["", ""])
    out = privileged_batch(b, tok, "A={answer};{prompt}|")
    rows = [enc("A=3;") + p0 + enc("|"), enc("A=30;") + p1 + enc("|")]
    width = max(map(len, rows))
    assert out.prompt_ids.tolist() == [[pad] * (width - len(r)) + r for r in rows]
    assert out.prompt_mask.tolist() == [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    assert torch.equal(out.response_ids, b.response_ids) and torch.equal(out.response_mask, b.response_mask)
    same = privileged_batch(b, tok, "{prompt}")
    assert torch.equal(same.prompt_ids[same.prompt_mask.bool()], ids[mask.bool()])


@pytest.mark.slow
def test_self_distillation_with_the_students_own_prompt_changes_nothing_and_with_the_answer_teaches(make_trainer):
    """distill.teacher=self, distill.privileged="{prompt}": the teacher is the student reading the same tokens, so its
    log-probs equal the student's bitwise and the step is bit-identical to the same step without distillation. With
    the answer shown, the teacher's log-probs of the same sampled tokens differ, and the advantage moves by exactly
    coef x (teacher - student) per token."""
    from rlcli.algos.functional import distill_advantages
    from rlcli.loop.trainer import rl_phase

    plain = make_trainer("save=false", run="plain")
    same = make_trainer("save=false", "distill.teacher=self", "distill.privileged='{prompt}'", run="same")
    a, b = plain.train_step(1), same.train_step(1)
    assert b["distill/reverse_kl"] == 0.0
    keys = [k for k in a if not k.startswith(("timing_s/", "perf/"))]
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    for (n, p), q in zip(plain.learner.actor.module.named_parameters(), same.learner.actor.module.parameters()):
        assert torch.equal(p, q), n
    from rlcli.loop.summary import startup_summary

    assert "distillation   teacher self (the policy reading '{prompt}')" in startup_summary(same)

    shown = make_trainer("save=false", "distill.teacher=self", "distill.coef=0.5", run="shown")
    batch, _ = shown.collect(shown.timer, 1)
    phase = rl_phase(shown.cfg)
    scored = batch.replace(**shown.learner.score(batch, 1, phase))
    # the teacher's log-probs are the actor's on prompts written out in full and encoded whole (the tiny tokenizer
    # is one token a character, so this is an independent path to the same tokens)
    tok = shown.tokenizer
    texts = [f"Reference answer: {a}\n" + tok.decode(ids[m.bool()]) for ids, m, a in
             zip(batch.prompt_ids, batch.prompt_mask, batch.answers)]
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    want = shown.learner.logprobs(batch.replace(prompt_ids=ids, prompt_mask=mask))  # [N, T]
    assert torch.equal(scored.teacher_logp, want)
    m = scored.response_mask.bool()
    assert not torch.equal(scored.old_logp[m], scored.teacher_logp[m])  # the answer changes what the teacher expects
    with_teacher = shown.advantage(scored, 1, phase)[0].advantages
    without = shown.advantage(scored.replace(teacher_logp=None), 1, phase)[0].advantages
    assert torch.allclose(with_teacher - without, distill_advantages(scored.old_logp, scored.teacher_logp,
                                                                     scored.loss_mask, 0.5, 0.0), atol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["distill.teacher=self", "distill.full_kl_coef=1.0"], "full-vocabulary KL"),
    (["distill.teacher=self", "distill.privileged='no prompt'"], "exactly once"),
    (["distill.teacher=self", "distill.privileged='{prompt} {hint}'"], "hint"),
    (["distill.privileged='Answer: {answer} {prompt}'"], "read by distill.teacher=self only"),
])
def test_self_distillation_config_errors_name_the_fix(overrides, message):
    from rlcli.config import validate
    from rlcli.core.schema import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))
