"""reward=rm (issue 35 §2): a reward model trained by `rlcli rm` scores each (prompt, response) of the loop's rollout
batches, in the RewardManager's one result beside the verifier: the loop's scores equal rlcli.models.reward.score and
transformers' own forward on the texts `rlcli rm` trains on (plain and chat), the batch normalisation against
hand-computed numbers, the config errors, the memory plan's row, and `rlcli train reward=rm` end to end.
CPU, fp32, seeded, tiny, offline."""

import json
import math

import pytest
import torch
from conftest import FAST, compose, metric_rows, rlcli

from rlcli.core.schema import ConfigError

TOL = dict(rtol=1e-5, atol=1e-5)
POLICY = [o for o in FAST if "sevens" not in o and o != "~reward.weights.math_verify"]
"""FAST without its scripted reward: the verifier stays (weight 0 below), the reward model is the signal."""
WITH_RM = ["reward=[math_verify,rm]", "reward.weights.math_verify=0"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A reward model `rlcli rm` trained for 2 steps (its trainer, in process) on the random-init tiny model: the
    directory it saves (~5 s)."""
    from rlcli.rm.train import RewardModelTrainer

    root = tmp_path_factory.mktemp("rm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLCLI_CACHE", str(root / "cache"))
        RewardModelTrainer(compose("model.warm_start.enabled=false", "rm.train_size=32", "rm.eval_size=8",
                                   "rm.batch_size=8", "hw.micro_batch=8", "rm.lr=1e-3", "steps=2", "checkpoint.every=0",
                                   "hw.num_threads=1", run_dir=str(root / "run"))).fit()
    return str(root / "run" / "reward_model")


def rollout(tokenizer, prompts, responses, ended, answers=None):
    """A RolloutBatch as the engines return it (rlcli.rollout.hf.rollout_batch): prompt i's 2 responses are rows
    2i, 2i+1; a response that `ended` carries the EOS token, the others none (truncated)."""
    from rlcli.rollout.hf import encode_prompts, rollout_batch

    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, 2)  # [N, Tp] left-padded
    rows = [tokenizer(r, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if e else [])
            for r, e in zip(responses, ended)]
    width = max(map(len, rows))
    response_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])  # [N, T]
    return rollout_batch(tokenizer, prompt_ids, prompt_mask, response_ids, None, answers or ["0"] * len(prompts), 2, 0)


# ------------------------------------------------------------------------------ the loop's score is rlcli rm's
def test_the_loop_scores_a_rollout_batch_as_rlcli_rm_and_transformers_do(rm_dir):
    """The RewardManager's `rm` part of each row equals rlcli.models.reward.score and a plain transformers forward on
    prompt + response (no EOS: `rlcli rm` pairs have none, and this tokenizer's EOS is not its pad token, so an EOS
    would move the score), one row at a time without padding; the verifier's acc is computed at weight 0."""
    from transformers import AutoModelForSequenceClassification

    from rlcli.models import load_tokenizer
    from rlcli.models.reward import score
    from rlcli.models.tiny import load_tiny_tokenizer
    from rlcli.rewards import RewardManager
    from rlcli.rm.pairs import arith_pairs

    policy = load_tiny_tokenizer()
    pairs = arith_pairs("eval", 3, 2, 2)
    prompts = [p["prompt"] for p in pairs]
    responses = [p[side] for p in pairs for side in ("chosen", "rejected")]
    answers = [p["chosen"].rsplit("{", 1)[1].rstrip("}") for p in pairs]
    b = rollout(policy, prompts, responses, ended=[True, True, True, False, True, True], answers=answers)
    cfg = compose(*POLICY, *WITH_RM, f"reward.rm.path={rm_dir}", "reward.rm.normalize=none")
    with RewardManager.for_run(cfg, policy) as manager:
        out, counts = manager.reward_batch(b)
    got = out.extras["reward/rm"]  # [N] raw
    texts = [p for p in prompts for _ in range(2)], responses  # as `rlcli rm` reads a pair: no EOS
    assert b.truncated.tolist() == [False, False, False, True, False, False] and b.texts == responses
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tokenizer = load_tokenizer(rm_dir)
    with torch.no_grad():
        plain = torch.cat([model(**tokenizer([p + r], add_special_tokens=False, return_tensors="pt")).logits[:, 0]
                           for p, r in zip(*texts)])
    torch.testing.assert_close(got, score(model, tokenizer, *texts), **TOL)
    torch.testing.assert_close(got, plain, **TOL)
    assert got.std() > 0  # the rows differ: equal numbers above are not one constant
    torch.testing.assert_close(out.scores, got)  # weights: math_verify 0, rm 1, normalize none
    assert out.acc.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0] and out.extras["reward/math_verify"].sum() == 3
    assert counts["reward/errors"] == 0


def test_a_chat_prompt_and_reply_are_the_texts_rlcli_rm_renders():
    """Chat mode: the prompt keeps its template's special tokens, an ended reply gets the template's end-of-turn
    text, as rlcli.rm.pairs.render_pair renders a chat pair; a truncated reply did not end its turn."""
    from rlcli.data.templates import render_prompt
    from rlcli.models.tiny import load_tiny_tokenizer
    from rlcli.rewards.model import ModelScorer
    from rlcli.rm.pairs import render_pair

    tokenizer = load_tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    question, chosen, rejected = "1+2=?", "3 \\boxed{3}", "4 \\boxed{4}"
    prompt = render_prompt(question, "question", True, tokenizer)
    text, c, r = render_pair(question, chosen, rejected, True, tokenizer)
    assert c == chosen + "</s>\n" and text == prompt
    b = rollout(tokenizer, [prompt], [chosen, rejected], ended=[True, False])
    prompts, responses = ModelScorer(None, None, tokenizer, chat=True, batch_size=1, normalize="none", clip=None).texts(b)
    assert prompts == [text, text] and responses == [c, rejected]


# ------------------------------------------------------------------------------ normalisation (golden)
# raw [1, 2, 3, 6]: mean 3, unbiased std sqrt((4 + 1 + 0 + 9) / 3) = sqrt(14/3) = 2.1602469;
# whitened (r - 3) / (2.1602469 + 1e-6) = [-0.9258196, -0.4629098, 0, 1.3887294]; clip 1 -> [..., 1.0].
# Regenerate: python -c "import torch; r = torch.tensor([1., 2, 3, 6]); print((r - r.mean()) / (r.std() + 1e-6))"
RAW = torch.tensor([1.0, 2.0, 3.0, 6.0])


@pytest.mark.parametrize("how,clip,want", [
    ("batch", None, [-0.9258196, -0.4629098, 0.0, 1.3887294]),
    ("batch", 1.0, [-0.9258196, -0.4629098, 0.0, 1.0]),
    ("none", None, [1.0, 2.0, 3.0, 6.0]),
    ("none", 2.5, [1.0, 2.0, 2.5, 2.5]),
])  # fmt: skip
def test_normalisation_golden_values(how, clip, want):
    from rlcli.rewards.config import NORMALIZE
    from rlcli.rewards.model import NORMALIZERS, normalized

    assert set(NORMALIZERS) == set(NORMALIZE)
    torch.testing.assert_close(normalized(RAW, how, clip), torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert normalized(torch.tensor([4.0]), "batch", None).tolist() == [0.0]  # one row: no spread to whiten by
    shifted = normalized(3 * RAW + 7, "batch", None)  # an offset and a scale are what whitening removes
    torch.testing.assert_close(shifted, normalized(RAW, "batch", None), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ config errors and the plan
def test_config_errors_name_the_key_before_anything_loads(tmp_path):
    from rlcli.commands.cli import check_inputs
    from rlcli.config import validate

    with pytest.raises(ConfigError, match=r"reward\.rm\.path is null: set reward\.rm\.path="):
        validate(compose(*WITH_RM))
    with pytest.raises(ConfigError, match=r"reward\.weights has no rm"):
        validate(compose(f"reward.rm.path={tmp_path}"))
    with pytest.raises(ConfigError, match="reward.custom.rm: the name 'rm' is taken"):
        validate(compose("+reward.custom.rm=pkg.fn", "+reward.weights.rm=1"))
    with pytest.raises(ConfigError, match=r"reward\.rm\.path=/no/such/dir: no such directory"):
        check_inputs(compose(*WITH_RM, "reward.rm.path=/no/such/dir"), ("train",))
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ConfigError, match=r"has no config\.json \(it holds weights\.bin\)"):
        check_inputs(compose(*WITH_RM, f"reward.rm.path={tmp_path}"), ("train",))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="holds LlamaForCausalLM with 1 label.s., not a reward model"):
        check_inputs(compose(*WITH_RM, f"reward.rm.path={tmp_path}"), ("train",))


def test_reward_rm_without_a_path_is_one_line_from_the_cli(tmp_path):
    from test_errors import assert_one_line
    from test_errors import rlcli as run

    assert_one_line(run(tmp_path, "train", *WITH_RM, f"hydra.run.dir={tmp_path}/run"), "reward.rm.path is null")


def test_the_memory_plan_counts_the_reward_model(rm_dir):
    from rlcli.plan.estimate import estimate
    from rlcli.plan.shapes import arch_of, rm_param_count

    without, with_rm = estimate(compose()), estimate(compose(*WITH_RM, f"reward.rm.path={rm_dir}"))
    psi = rm_param_count(arch_of(compose().model))  # the reward model is a tiny model too
    assert "reward model" not in without.rows and with_rm.rows["reward model"] == psi * 4  # fp32
    assert with_rm.peak == pytest.approx(without.peak + psi * 4)
    x2 = ("hw=cpu_x2", *WITH_RM, f"reward.rm.path={rm_dir}")
    assert estimate(compose(*x2, "hw.zero_stage=3")).rows["reward model"] == psi * 4 / 2  # partitioned like the ref
    assert estimate(compose(*x2, "hw.zero_stage=3", "rollout.async.max_staleness=0")).rows["reward model"] == psi * 4


# ------------------------------------------------------------------------------ end to end
def train(tmp_path, rm_dir, run, *extra):
    return rlcli(tmp_path, "train", *POLICY, *WITH_RM, f"reward.rm.path={rm_dir}", "steps=2", "eval.before=false",
                 "checkpoint.every=0", "hw=cpu_x2", *extra, f"hydra.run.dir={tmp_path / run}")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, rm_dir):
    """`rlcli train reward=[math_verify,rm] reward.weights.math_verify=0 ...` for 2 steps in one process
    (hw=cpu_x2 hw.nproc=1: the arithmetic of the asynchronous job's one training rank): (its stdout, its run dir)."""
    tmp = tmp_path_factory.mktemp("sync")
    return train(tmp, rm_dir, "run", "hw.nproc=1").stdout, tmp / "run"


@pytest.mark.slow
def test_rlcli_train_with_reward_rm_logs_the_model_score_beside_the_verifier(sync_run, rm_dir):
    stdout, run = sync_run
    assert f"rm = reward model {rm_dir}, normalize=batch" in stdout
    rows = [r for r in metric_rows(run) if "reward/rm" in r]
    assert len(rows) == 2
    from metric_names import undocumented

    assert not undocumented({k for r in rows for k in r}), "add them to docs/metrics.md"
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("reward/rm", "reward/rm_std", "acc/mean", "reward/math_verify"))
        assert r["reward/rm_std"] > 0 and abs(r["reward/mean"]) < 1e-3  # whitened per batch: mean 0 (one rank)


@pytest.mark.slow
def test_asynchronous_rollout_scores_on_the_rollout_rank_as_the_synchronous_run(tmp_path, sync_run, rm_dir):
    """One training rank and one rollout rank at max_staleness=0: the rollout rank loads the reward model and
    scores its batches; every metric equals the synchronous run's (test_async's bit-for-bit check)."""
    from test_async import same_training

    out = train(tmp_path, rm_dir, "async", "rollout.async.max_staleness=0")
    assert "normalize=batch, on the rollout ranks" in out.stdout
    assert same_training(sync_run[1], tmp_path / "async")


@pytest.mark.slow
def test_zero3_partitions_the_reward_model_and_scores_as_whole_copies_do(tmp_path, rm_dir):
    """hw=cpu_x2 at ZeRO-3: each training rank holds a slice of the reward model (built partitioned, like the
    reference model) and every scoring forward gathers its layers from both ranks; the two steps' rewards, losses
    and statistics equal those of ZeRO-0, where each rank holds it whole (1e-5 relative: float32 summation order).
    A rank scoring other rows than it holds, or a mismatched forward count (a hang, turned into an error by
    hw.collective_timeout_s), fails it."""
    whole = train(tmp_path, rm_dir, "z0", "hw.num_threads=1")
    parted = train(tmp_path, rm_dir, "z3", "hw.num_threads=1", "hw.zero_stage=3", "hw.collective_timeout_s=120")
    assert "partitioned over the ranks (ZeRO-3)" in parted.stdout and "partitioned" not in whole.stdout
    rows = [[r for r in metric_rows(tmp_path / run) if "reward/rm" in r] for run in ("z0", "z3")]
    assert [r["step"] for r in rows[1]] == [1, 2]
    for r0, r3 in zip(*rows):
        for k in ("reward/rm", "reward/rm_std", "reward/mean", "acc/mean", "actor/pg_loss", "actor/grad_norm"):
            assert r3[k] == pytest.approx(r0[k], rel=1e-5, abs=1e-7), (r0["step"], k)

