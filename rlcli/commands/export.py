"""`rlcli export RUN_DIR OUT_DIR`: a run's policy as a Hugging Face model directory with a model card, and
optionally uploaded to the Hub (`--push`).

The weights are copied, not rebuilt: `rlcli train` already saves the policy with `save_pretrained` + its tokenizer
(run_dir/policy, and run_dir/hf/step_<N> with checkpoint.hf_every), a LoRA policy merged into its base weights
(rlcli/engine save_policy). The card (OUT_DIR/README.md) is written from what the run directory holds: the frozen
config.yaml, result.json (held-out numbers before and after training), metrics.jsonl (the last training step) and
Hydra's .hydra/ (the command line). The run's config travels too, as OUT_DIR/rlcli_config.yaml.

Light at import, like every command: huggingface_hub is imported only to push to the Hub.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from rlcli import __version__
from rlcli.models.config import HUB_ID

LOCAL_TARGET = "file://"
"""--push file:///abs/dir: a local directory stands for the Hub repository (what upload_folder would leave there);
it is how the push is tested offline."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlcli export",
        description="Copy a run's trained policy (Hugging Face format: AutoModelForCausalLM.from_pretrained loads "
        "it) into OUT_DIR with a model card, README.md: base model, algorithm, data, reward, the held-out numbers "
        "before and after training, the command that trained it. Optionally upload OUT_DIR to the Hub.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished `rlcli train` run directory (holding config.yaml)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="where to write the model and its card (new or empty)")
    p.add_argument("--hf-step", type=int, default=None, metavar="N",
                   help="export the snapshot run_dir/hf/step_N (written with checkpoint.hf_every) instead of the "
                   "final policy run_dir/policy")
    p.add_argument("--merge-lora", action="store_true",
                   help="accepted for clarity, changes nothing: rlcli always saves a LoRA policy merged into its "
                   "base weights (a plain transformers model, no peft needed); the adapters alone live only in "
                   "the run's checkpoints")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    p.add_argument("--license", default=None, metavar="ID",
                   help="license of the weights for the card's metadata (e.g. apache-2.0); default: the base "
                   "model's, when its local directory has a card that names one")
    p.add_argument("--push", default=None, metavar="REPO",
                   help="then upload OUT_DIR to the Hub repository REPO (user/name; created if missing) with "
                   "huggingface_hub: needs network, HF_HUB_OFFLINE=0 (rlcli runs offline by default) and a token "
                   "(HF_TOKEN or `hf auth login`). REPO=file:///abs/dir copies to a local directory instead")
    p.add_argument("--private", action="store_true", help="with --push: create the repository private")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    run, out = Path(args.run_dir), Path(args.out_dir).resolve()
    cfg = read_config(run)
    source = policy_dir(run, cfg, args.hf_step)
    check_out_dir(out, source, args.force)
    if args.push is not None:
        check_push(args.push, out)  # before anything is written: a refused push leaves nothing to clean up
    if args.private and args.push is None:
        raise SystemExit("--private applies to --push REPO only: add --push, or drop --private")

    tmp = out.with_name(out.name + ".tmp")  # written whole, then renamed: OUT_DIR is never half a model
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    shutil.copy2(run / "config.yaml", tmp / "rlcli_config.yaml")
    (tmp / "README.md").write_text(model_card(run, cfg, args.hf_step, args.license, args.push, out.name))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    if args.merge_lora:
        print("--merge-lora: nothing to do, the saved policy is already merged"
              + ("" if cfg.model.lora.r else " (and this run trained without LoRA)"))
    print(f"exported {source} to {out} (AutoModelForCausalLM.from_pretrained loads it; model card: {out}/README.md)")
    if args.push is not None:
        print(f"pushed {out} to {push(out, args.push, args.private)}")
    return 0


# ---------------------------------------------------------------------------------------- what to export
def read_config(run: Path) -> Any:
    from rlcli.config import load_frozen

    if not (run / "config.yaml").is_file():
        what = "no such directory" if not run.is_dir() else "it has no config.yaml"
        raise SystemExit(f"{run} is not an `rlcli train` run directory ({what}): pass the run's hydra.run.dir, the "
                         "directory holding config.yaml and policy/")
    return load_frozen(str(run / "config.yaml"))


def policy_dir(run: Path, cfg: Any, hf_step: int | None) -> Path:
    """run/policy, or run/hf/step_<hf_step>; refused, with what the run does hold, when it is not there."""
    snapshots = sorted(int(p.name.removeprefix("step_")) for p in (run / "hf").glob("step_*")
                        if p.name.removeprefix("step_").isdigit() and (p / "config.json").is_file())
    held = f"snapshots of steps {', '.join(map(str, snapshots))} (--hf-step N)" if snapshots else "no hf/ snapshot"
    if not cfg.save:
        raise SystemExit(f"{run} saved no weights (save=false): train it again with save=true (checkpoint.hf_every=N "
                         "also keeps a snapshot every N steps)")
    if hf_step is not None:
        path = run / "hf" / f"step_{hf_step}"
        if not (path / "config.json").is_file():
            raise SystemExit(f"{run} has no Hugging Face snapshot of step {hf_step} (hf/step_{hf_step}): it holds "
                             f"{held}; snapshots are written every checkpoint.hf_every steps")
        return path
    path = run / "policy"
    if not (path / "config.json").is_file():
        finished = (run / "result.json").is_file()
        raise SystemExit(f"{run} has no policy/ ({'it was removed' if finished else 'the run did not finish'}): it "
                         f"holds {held}; resume the run with resume=auto, or train with checkpoint.hf_every=N to "
                         "keep snapshots")
    return path


def check_out_dir(out: Path, source: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise SystemExit(f"OUT_DIR {out} is a file: choose a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise SystemExit(f"OUT_DIR {out} exists and is not empty: choose a new directory, or pass --force to "
                         "replace it")
    o, s = out.resolve(), source.resolve()
    if o == s or o in s.parents or s in o.parents:  # --force would delete the source, or copy it into itself
        raise SystemExit(f"OUT_DIR {out} overlaps the run's own files ({source}): export to a directory outside "
                         "them")


# ---------------------------------------------------------------------------------------- the model card
def model_card(run: Path, cfg: Any, hf_step: int | None, license_id: str | None, repo: str | None,
               title: str) -> str:
    """README.md: Hugging Face metadata (YAML front matter), then the run in prose and tables."""
    import yaml

    result = json.loads((run / "result.json").read_text()) if (run / "result.json").is_file() else None
    base_id = cfg.model.path if cfg.model.path and is_hub_id(cfg.model.path) else None
    license_id = license_id or base_license(cfg.model.path)
    meta: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    if base_id:
        meta["base_model"] = base_id
    if license_id:
        meta["license"] = license_id
    meta["tags"] = ["rlcli", "reinforcement-learning", cfg.algo.name] + (["lora"] if cfg.model.lora.r else [])

    step = hf_step if hf_step is not None else cfg.steps
    which = ("the final policy (`policy/`)" if hf_step is None
             else f"the snapshot of step {hf_step} (`hf/step_{hf_step}`, checkpoint.hf_every)")
    hub_repo = repo if repo and not repo.startswith(LOCAL_TARGET) else None
    name = hub_repo or "path/to/this/directory"
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "",
        f"# {hub_repo.split('/')[-1] if hub_repo else title}", "",
        f"{base_description(cfg)} trained with reinforcement learning by rlcli (`algo={cfg.algo.name}` on "
        f"`data={cfg.data.name}`); these weights are {which}, after {step} of {cfg.steps} training steps.", "",
        "## Base model", "",
        f"- {base_description(cfg, long=True)}",
        f"- {lora_description(cfg)}", "",
        "## Training", "",
        "| knob | value |", "|---|---|",
        *[f"| `{k}` | {v} |" for k, v in knobs(cfg)], "",
        f"- data: `data.name={cfg.data.name}` (source `{cfg.data.source}`), `data.train_size={cfg.data.train_size}`, "
        f"`data.eval_size={cfg.data.eval_size}`" + (f"; environment `env.name={cfg.env.name}`" if cfg.env.name else ""),
        f"- reward: weights {inline(dict(cfg.reward.weights))}"
        + (f", user functions {inline(dict(cfg.reward.custom))}" if cfg.reward.custom else ""),
        f"- steps: {cfg.steps}, seed {cfg.seed}"
        + (f"; {result['train_seconds']:.1f} s in training steps" if result and "train_seconds" in result else ""),
        "",
        *evaluation(cfg, result, hf_step),
        *last_step(run, cfg),
        "## Reproduce", "",
        "```bash", command(run), "```", "",
        "The full resolved config is `rlcli_config.yaml` beside this card.", "",
        "## Use", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        "```", "",
        f"Trained with rlcli {(result or {}).get('rlcli_version', '(its version was not recorded)')}; exported "
        f"{datetime.date.today().isoformat()} with rlcli {__version__}{finished(run)}.",
    ]
    return "\n".join(lines) + "\n"


def base_description(cfg: Any, long: bool = False) -> str:
    m = cfg.model
    if m.path is not None:
        return f"`{m.path}`" if not long else f"`model.path={m.path}` (preset `model={m.name}`)"
    if m.gguf_file is not None:
        return (f"`{m.name}`" if not long else
                f"`model.gguf_file={m.gguf_file}` (preset `model={m.name}`), converted to Hugging Face format by rlcli")
    t = m.tiny
    if not long:
        return "The embedded tiny Llama"
    start = ("warm-started by supervised training on the arith task "
             f"(`model.warm_start`: {m.warm_start.steps} steps, seed {m.warm_start.seed})"
             if m.warm_start.enabled else "at random initialisation (`model.warm_start.enabled=false`)")
    return (f"rlcli's embedded tiny Llama (`model.tiny`: {t.num_layers} layers, hidden {t.hidden_size}, "
            f"{t.num_heads} heads, character vocabulary), {start}")


def lora_description(cfg: Any) -> str:
    lora = cfg.model.lora
    if not lora.r:
        return "full fine-tuning: every weight trained (no LoRA)"
    return (f"LoRA (`model.lora`: r={lora.r}, alpha={lora.alpha:g}, on {', '.join(lora.target_modules)}), merged "
            "into the base weights when saved: a plain transformers model, no peft needed")


def knobs(cfg: Any) -> list[tuple[str, Any]]:
    """The knobs that say which algorithm ran; the DAPO switches only when on."""
    a, r = cfg.algo, cfg.rollout
    rows = [("algo", a.name), ("algo.adv_estimator", a.adv_estimator), ("algo.policy_loss", a.policy_loss),
            ("algo.loss_agg", a.loss_agg), ("algo.clip_low / clip_high", f"{a.clip_low:g} / {a.clip_high:g}"),
            ("algo.kl_coef", f"{a.kl_coef:g}" + (f" ({a.kl_estimator})" if a.kl_coef else "")),
            ("algo.ppo_epochs x mini_batches", f"{a.ppo_epochs} x {a.mini_batches}"),
            ("optim.lr", f"{cfg.optim.lr:g}"),
            ("rollout.prompts_per_step x n", f"{r.prompts_per_step} x {r.n}"),
            ("rollout.max_new_tokens", r.max_new_tokens), ("rollout.temperature", f"{r.temperature:g}")]
    rows += [(f"algo.{k}", "true") for k in ("dynamic_sampling", "overlong_filter", "soft_overlong") if a[k]]
    rows += [(f"algo.{k}", f"{a[k]:g}") for k in ("entropy_coef", "nll_coef") if a[k]]
    return rows


def evaluation(cfg: Any, result: dict[str, Any] | None, hf_step: int | None) -> list[str]:
    if result is None:
        return ["## Evaluation", "", "None: the run did not finish (no result.json).", ""]
    before, after = result.get("eval_before", {}), result.get("eval_after", {})
    e = cfg.eval
    how = ("greedy" if e.temperature == 0 else f"temperature {e.temperature:g}, top_p {e.top_p:g}") + f", k={e.k}"
    lines = ["## Evaluation", "",
             f"Held-out prompts of `{cfg.data.name}` ({how}), from the run's result.json; `eval/acc` is accuracy "
             "(0-1)."]
    if hf_step is not None and hf_step != cfg.steps:
        lines += ["", f"**These numbers are the final policy's (step {cfg.steps}), not this snapshot's (step "
                      f"{hf_step}):** `rlcli eval model.path=<this directory>` measures it."]
    lines += ["", "| metric | before training | after training |", "|---|---|---|"]
    lines += [f"| {k} | {num(before.get(k))} | {num(after.get(k))} |" for k in dict.fromkeys([*after, *before])]
    return lines + [""]


def last_step(run: Path, cfg: Any) -> list[str]:
    """The last training step's reward, accuracy and length (metrics.jsonl), when it was logged."""
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    rows = [r for r in rows if "reward/mean" in r]
    if not rows:
        return []
    row = rows[-1]
    keys = [k for k in ("reward/mean", "acc/mean", "response_length/mean") if k in row]
    return ([f"## Last training step (step {row['step']}, metrics.jsonl)", "", "| metric | value |", "|---|---|"]
            + [f"| {k} | {num(row[k])} |" for k in keys] + [""])


def command(run: Path) -> str:
    """`rlcli train <the overrides it was given>`, from Hydra's record (.hydra/); the run directory left out."""
    from omegaconf import OmegaConf

    overrides = run / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return ("# the command line was not recorded (no .hydra/overrides.yaml): rlcli_config.yaml holds every "
                "value it ran with")
    args = [str(a) for a in OmegaConf.load(overrides)]
    hydra = run / ".hydra" / "hydra.yaml"
    if hydra.is_file():  # --config-dir is a search path to Hydra, not an override
        sources = OmegaConf.load(hydra).hydra.runtime.config_sources
        args = [f"--config-dir {s.path}" for s in sources if s.provider == "command-line"] + args
    return " ".join(["rlcli train", *(a if a.startswith("--config-dir") else shlex.quote(a) for a in args)])


def finished(run: Path) -> str:
    if not (run / "result.json").is_file():
        return ""
    when = datetime.datetime.fromtimestamp((run / "result.json").stat().st_mtime)
    return f"; the run finished {when.date().isoformat()}"


def num(v: Any) -> str:
    return "-" if v is None else f"{v:.4g}"


def inline(d: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in d.items())


def is_hub_id(path: str) -> bool:
    return bool(HUB_ID.fullmatch(path)) and not os.path.exists(os.path.expanduser(path.split("/")[0]))


def base_license(path: str | None) -> str | None:
    """The license in the front matter of a local base model's README.md, if any."""
    import yaml

    card = Path(os.path.expanduser(path)) / "README.md" if path else None
    if card is None or not card.is_file():
        return None
    text = card.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    try:
        meta = yaml.safe_load(text.split("---", 2)[1]) or {}
    except yaml.YAMLError:
        return None
    return meta.get("license") if isinstance(meta, dict) else None


# ---------------------------------------------------------------------------------------- the upload
def check_push(repo: str, out: Path) -> None:
    """Refuse a push that cannot work (offline, no token, not a repo id) before anything is written."""
    if repo.startswith(LOCAL_TARGET):
        if not Path(repo.removeprefix(LOCAL_TARGET)).is_absolute():
            raise SystemExit(f"--push {repo}: a local target is an absolute path, file:///abs/dir")
        return
    if not HUB_ID.fullmatch(repo):
        raise SystemExit(f"--push {repo}: a Hub repository is named user/name (or org/name)")
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise SystemExit(f"--push {repo}: HF_HUB_OFFLINE=1 (rlcli runs offline by default): run with HF_HUB_OFFLINE=0 "
                         f"rlcli export ... --push {repo}, or export without --push and upload with "
                         f"`hf upload {repo} {out}`")
    from huggingface_hub import get_token

    if get_token() is None:
        raise SystemExit(f"--push {repo}: no Hugging Face token: set HF_TOKEN or run `hf auth login`")


def push(out: Path, repo: str, private: bool) -> str:
    """Upload OUT_DIR to the Hub repository `repo` (created if missing), or copy it to a local target as
    upload_folder would leave the repository: OUT_DIR's files added or replaced, the others kept. -> where"""
    if repo.startswith(LOCAL_TARGET):
        target = Path(repo.removeprefix(LOCAL_TARGET))
        target.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out, target, dirs_exist_ok=True)
        return str(target)
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo, private=True if private else None, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo, folder_path=str(out), repo_type="model",
                          commit_message=f"rlcli export of {out.name}")
    except Exception as e:  # network, permissions, a token without write access: the export itself is done
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"--push {repo} failed ({type(e).__name__}: {first}); {out} is complete: retry with "
                         f"`hf upload {repo} {out}`") from e
    return str(url)
