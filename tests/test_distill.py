"""On-policy distillation (distill.*, algo=distill): the per-token advantage by hand, a teacher equal to the student
changing nothing bit for bit, the teacher's tokenizer checked before any weights load."""

import json
import shutil
import time

import pytest
import torch

from conftest import FAST, compose

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


def test_a_teacher_with_another_tokenizer_is_refused_before_any_weights_load(tmp_path):
    """The tiny student's tokenizer with two token ids swapped: refused, naming the key and the fix, in under 2 s."""
    from rlcli.models.config import check_teacher
    from rlcli.models.tiny import TOKENIZER_DIR
    from rlcli.schema import ConfigError

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
    from rlcli.schema import ConfigError

    with pytest.raises(ConfigError, match=r"algo=distill .* set distill.teacher="):
        validate(compose(*FAST, "algo=distill", run_dir="/tmp/unused"))
