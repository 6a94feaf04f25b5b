"""The `judge` part of the task reward (reward=judge, docs/reward_models.md#rewardjudge): a generative judge reads a
rubric holding the policy's prompt, the response and the task's reference answer, and its reply is parsed to a verdict
in [0, 1]. Greedy (temperature 0), so a resumed run equals a straight one.

Two backends, one interface `ask(list of rubric texts) -> list of reply texts | None (no answer)`:
  ServerJudge  an OpenAI-compatible server (reward.judge.url, .model): POST <url>/v1/chat/completions, the rubric as
               one user message; threads (reward.judge.concurrency), a per-request timeout, bounded retries with
               exponential back-off. Stdlib urllib: nothing to install, nothing imported at validation.
  LocalJudge   a local causal LM (reward.judge.path) in this process, through rlcli's HF generation
               (rlcli.rollout.hf.generate) or an in-process vLLM engine (reward.judge.engine=vllm), the rubric
               rendered with the judge tokenizer's chat template if it has one.

Every reply is cached, keyed by the SHA-256 of the request (the judge's identity, the messages, the sampling
parameters: never the URL or the key), in run_dir/judge_cache/rank_<r>.jsonl, appended as answers arrive; a
checkpoint carries a copy (rlcli.loop.checkpoint.CARRIED) and a run resumed from it into another run directory starts
with it, so no resumed run re-asks what it already has. Failures are not cached.

A request nobody answers (after reward.judge.retries) fails the step with JudgeUnavailable, a one-line error
naming the judge, raised in stage 2, before any update, so the latest checkpoint is the last good step; or, with
reward.judge.on_error=zero, scores 0 and counts in reward/judge_errors.

How a reply is read (read_verdict; docs/reward_models.md, "The verdict", states the same rule). Markdown emphasis and
code marks (**, *, __, backticks) are dropped. The verdict is the reply's last labelled one, or, in a reply without a
labelled one, its last unlabelled one. A label is the word score, rating, grade or verdict (`Final verdict:`,
`"overall_score":`, `Rating: [[8]]`) followed by its value. The value and the unlabelled verdict, by reward.judge.verdict:
  score   a number (8, 7.5, .5, -1), or <n>/<d> or <n> out of <d>; unlabelled, only <n>/<max> or <n> out of <max>. It
          maps linearly from [min_score, max_score] to [0, 1]; a number out of that range, or over a denominator other
          than max_score, is no score.
  yes_no  a clause (the text between punctuation marks) ending in yes or correct (1), no or incorrect (0), flipped by
          a negation in the clause (not, cannot, never, n't): `not correct` and `isn't correct` are 0. A clause
          ending in another word (`no doubt`), ending in `?`, or holding whether or if states none.
A reply without a verdict (a refusal), or whose verdict is no score, reads None: it scores 0 and counts in
reward/judge_unparsed. A reply whose verdict is the maximum (1) but that states a lower one too, in another labelled
verdict or in an unlabelled one after it (`Verdict: no` ... `Verdict: yes`; `Score: 10` then `3/10`), contradicts
itself: it scores its verdict and is flagged for the reward audit (reward/audit_flagged). The built-in rubrics
(rlcli.rewards.config.RUBRICS) ask for a fixed last line, `Score: <n>` or one word yes/no; no response format is
requested (docs/reward_models.md says why), so free text is read as above.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlcli.core.schema import ConfigError
from rlcli.rewards.code import AUDIT
from rlcli.rewards.config import RUBRICS

CACHE_DIR = "judge_cache"
"""The run-directory folder of the judge's replies (one JSONL file per rank); rlcli.loop.checkpoint carries it."""

_MARKS = re.compile(r"\*+|__+|`+")
"""Markdown emphasis and code marks, dropped before reading: `**Score:** 8` reads as `Score: 8`."""
_LABEL = r"(?<![a-z])(?:score|rating|grade|verdict)(?![a-z])(?:\s*\([^)\n]*\))?[\s\"'\[]*(?:(?:is|of)\b)?[\s\"'\[:=]*"
"""A label and what may stand between it and its value: `Score (0-10):`, `"score": "`, `Rating: [[`, `verdict is`."""
_NUMBER = r"(-?(?:\d+(?:\.\d+)?|\.\d+))"
_OF = r"\s*(?:/|out\s+of)\s*"
_ENDS = ".,;:!?\n\"(){}\\[\\]"  # what ends a clause
_CLAUSE = (rf"((?:(?!\b(?:whether|if)\b)[^{_ENDS}])*?\b(yes|no|correct|incorrect))[ \t]*"
           rf"(?=[{_ENDS.replace('?', '')}]|$)")
"""A yes_no verdict: a clause ending in a verdict word (group 2), not a question; group 1 is the clause."""
_WORDS = {"yes": 1.0, "correct": 1.0, "no": 0.0, "incorrect": 0.0}
_NEGATION = re.compile(r"\b(?:not|cannot|never)\b|n['’]t\b", re.IGNORECASE)


class JudgeUnavailable(ConfigError):
    """The judge did not answer a request after its retries (reward.judge.on_error=fail): the step stops, one line
    (`rlcli: error: ...`), before any update."""


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def rubric_text(j: Any, prompt: str, response: str, reference: str) -> str:
    """The judge's prompt: reward.judge.rubric (or the verdict's built-in one) with its placeholders filled. Plain
    replacement, not str.format: a rubric or a response may hold braces (\\boxed{})."""
    text = j.rubric if j.rubric is not None else RUBRICS[j.verdict]
    fill = {"{min}": _number(j.min_score), "{max}": _number(j.max_score), "{prompt}": prompt,
            "{reference}": reference or "(none)", "{response}": response}
    # One pass, so a response holding "{reference}" is not filled in turn.
    return re.sub("|".join(re.escape(k) for k in fill), lambda m: fill[m.group(0)], text)


def _score_syntax(lo: float, hi: float) -> tuple[str, str, Any]:
    def value(m: re.Match[str]) -> float | None:
        n = float(m[1])
        on_scale = lo <= n <= hi and (m[2] is None or float(m[2]) == hi)
        return (n - lo) / (hi - lo) if on_scale else None

    return rf"{_LABEL}{_NUMBER}(?:{_OF}{_NUMBER})?", rf"{_NUMBER}{_OF}({re.escape(_number(hi))})(?!\.?\d)", value


def _yes_no_syntax(lo: float, hi: float) -> tuple[str, str, Any]:
    def value(m: re.Match[str]) -> float | None:
        v = _WORDS[m[2].lower()]
        return 1.0 - v if _NEGATION.search(m[1]) else v

    return _LABEL + _CLAUSE, rf"(?:^|(?<=[{_ENDS}])){_CLAUSE}", value


SYNTAX = {"score": _score_syntax, "yes_no": _yes_no_syntax}
"""reward.judge.verdict -> (lo, hi) -> (the labelled pattern, the unlabelled one, a match -> its verdict in [0, 1] or
None when it is no score)."""


def read_verdict(reply: str, verdict: str, lo: float, hi: float) -> tuple[float | None, bool]:
    """(the reply's verdict in [0, 1], or None without one; whether it contradicts itself), by the rule of this
    module's docstring; `lo`, `hi`: the score range (reward.judge.min_score, max_score)."""
    text = _MARKS.sub("", reply)
    labelled, unlabelled, value = SYNTAX[verdict](lo, hi)
    found = {kind: list(re.finditer(pattern, text, re.IGNORECASE)) for kind, pattern in
             (("labelled", labelled), ("unlabelled", unlabelled))}
    chosen = (found["labelled"] or found["unlabelled"] or [None])[-1]
    if chosen is None:
        return None, False
    v = value(chosen)
    others = [m for m in found["labelled"] if m is not chosen]
    others += [m for m in found["unlabelled"] if m.start() >= chosen.end()]
    return v, v == 1.0 and any(value(m) not in (None, 1.0) for m in others)


def parse_verdict(reply: str, verdict: str, lo: float, hi: float) -> float | None:
    """The reply's verdict in [0, 1], or None without one (read_verdict)."""
    return read_verdict(reply, verdict, lo, hi)[0]


class JudgeCache:
    """Replies by request key: every run_dir/judge_cache/*.jsonl read at start (a partial last line, from a kill
    while writing, is skipped), new ones appended to this rank's file and flushed (a SIGKILL loses none)."""

    def __init__(self, run_dir: str):
        self.dir = os.path.join(run_dir, CACHE_DIR)
        os.makedirs(self.dir, exist_ok=True)
        self.replies: dict[str, str] = {}
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".jsonl"):
                with open(os.path.join(self.dir, name)) as f:
                    for line in f:
                        try:
                            row = json.loads(line)
                            self.replies[row["key"]] = row["reply"]
                        except (ValueError, KeyError, TypeError):
                            continue
        self.file = open(os.path.join(self.dir, f"rank_{os.environ.get('RANK', '0')}.jsonl"), "a")  # noqa: SIM115

    def get(self, key: str) -> str | None:
        return self.replies.get(key)

    def put(self, new: dict[str, str]) -> None:
        for key, reply in new.items():
            self.replies[key] = reply
            self.file.write(json.dumps({"key": key, "reply": reply}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def request_key(request: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()


def endpoint(url: str) -> str:
    """<url>/v1/chat/completions, whether `url` ends at the host, at /v1 or at the full path."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class ServerJudge:
    """An OpenAI-compatible chat-completions server. `ask` -> each reply, None where the request failed after
    reward.judge.retries (the last failure in `self.last_error`)."""

    def __init__(self, j: Any):
        self.j, self.url = j, endpoint(j.url)
        self.identity = {"backend": "server", "model": j.model}
        self.last_error = ""
        key = os.environ.get(j.api_key_env, "") if j.api_key_env else ""
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def request(self, text: str) -> dict[str, Any]:
        """The body of one request (greedy), also what the cache key hashes (with the model's name)."""
        return {"model": self.j.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.j.max_tokens}

    def _once(self, body: bytes) -> str:
        req = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.j.timeout_s) as resp:
            reply = json.loads(resp.read())["choices"][0]["message"]["content"]
        if not isinstance(reply, str):
            raise ValueError(f"a reply without a message ({type(reply).__name__})")
        return reply

    def _ask_one(self, text: str) -> str | None:
        body = json.dumps(self.request(text)).encode()
        for attempt in range(self.j.retries + 1):
            try:
                return self._once(body)
            except urllib.error.HTTPError as e:
                self.last_error = f"HTTP {e.code} {e.reason}"
                if 400 <= e.code < 500 and e.code not in (408, 429):  # the request itself is wrong: retrying won't help
                    return None
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:  # refused, timed out, not JSON, ...
                reason = getattr(e, "reason", None)
                self.last_error = f"{type(e).__name__}: {reason if reason is not None else e}"
            if attempt < self.j.retries:
                time.sleep(self.j.backoff_s * 2**attempt)
        return None

    def ask(self, texts: Sequence[str]) -> list[str | None]:
        with ThreadPoolExecutor(max_workers=min(self.j.concurrency, max(len(texts), 1))) as pool:
            return list(pool.map(self._ask_one, texts))

    def describe(self) -> str:
        return f"reward.judge.url={self.j.url} (model {self.j.model})"

    def close(self) -> None:
        pass


class LocalJudge:
    """A local causal LM judged in this process, greedy, the rubric as a user turn of the judge tokenizer's chat
    template (plain text without one), through one of rlcli's engines (reward.judge.engine): hf
    (rlcli.rollout.hf.generate) or vllm (rlcli.rollout.vllm.VLLMEngine.frozen: an engine of the judge's directory).
    Either reads the replies' tokens with the judge's tokenizer as the rollout does. It always answers."""

    def __init__(self, j: Any, cfg: Any):
        import torch
        from omegaconf import OmegaConf

        from rlcli.models import load_policy, load_tokenizer

        self.j, self.last_error, self.model, self.engine = j, "", None, None
        self.identity = {"backend": "local", "path": os.path.abspath(os.path.expanduser(j.path))}
        if j.engine == "vllm":  # replies may differ from HF's in the last bits: not each other's cache entries
            from rlcli.rollout.vllm import VLLMEngine

            self.identity["engine"] = "vllm"
            self.tokenizer = load_tokenizer(j.path, cfg.model.trust_remote_code)
            self.engine = VLLMEngine.frozen(j.path, self.tokenizer, cfg, j.gpu_memory_utilization)
            return
        model_cfg = OmegaConf.merge(cfg.model, {"path": j.path, "tokenizer_path": None, "gradient_checkpointing": False,
                                                "lora": {"r": 0}})
        self.model, self.tokenizer = load_policy(model_cfg, j.path)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cfg.hw.device == "cuda" else "cpu"
        self.model.to(device).eval().requires_grad_(False)

    def request(self, text: str) -> dict[str, Any]:
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return {"prompt": text, "temperature": 0.0, "max_tokens": self.j.max_tokens}

    def ask(self, texts: Sequence[str]) -> list[str | None]:
        import torch

        from rlcli.rollout.hf import generate
        from rlcli.rollout.sampling import Sampling

        prompts = [self.request(t)["prompt"] for t in texts]
        if self.engine is not None:
            return list(self.engine.generate(prompts, [""] * len(prompts), 1, Sampling(self.j.max_tokens, 0.0)).texts)
        with torch.no_grad():
            b = generate(self.model, self.tokenizer, prompts, [""] * len(prompts), 1, self.j.max_tokens, 0.0,
                         batch_size=self.j.batch_size)
        return list(b.texts)

    def describe(self) -> str:
        return f"reward.judge.path={self.j.path}" + (" (engine vllm)" if self.engine is not None else "")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.model = self.engine = None


class JudgeScorer:
    """reward=judge's scorer (rlcli.rewards.scorer): a RolloutBatch -> Scored, raw = value = verdicts [N] in [0, 1]."""

    def __init__(self, backend: Any, j: Any, run_dir: str, policy_tokenizer: Any):
        self.backend, self.j, self.policy_tokenizer = backend, j, policy_tokenizer
        self.cache = JudgeCache(run_dir)

    @classmethod
    def of_run(cls, cfg: Any, policy_tokenizer: Any) -> JudgeScorer:
        j = cfg.reward.judge
        backend = ServerJudge(j) if j.url is not None else LocalJudge(j, cfg)
        return cls(backend, j, cfg.run_dir, policy_tokenizer)

    def texts(self, b: Any) -> list[str]:
        """The rubric text of each row [N]: the policy's prompt (decoded, special tokens dropped), the response as
        the verifiers read it, the task's answer as the reference."""
        prompts = self.policy_tokenizer.batch_decode([ids[m.bool()] for ids, m in zip(b.prompt_ids, b.prompt_mask)],
                                                     skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return [rubric_text(self.j, p, r, a) for p, r, a in zip(prompts, b.texts, b.answers)]

    def replies(self, texts: Sequence[str]) -> tuple[list[str | None], list[bool]]:
        """Each text's reply (None: not answered) and whether the cache held it; only the texts not cached (each
        distinct one once) are asked, and their answers cached."""
        keys = [request_key({**self.backend.identity, **self.backend.request(t)}) for t in texts]
        cached = [self.cache.get(k) is not None for k in keys]
        todo = {k: t for k, t, hit in zip(keys, texts, cached) if not hit}
        asked = dict(zip(todo, self.backend.ask(list(todo.values())))) if todo else {}
        self.cache.put({k: r for k, r in asked.items() if r is not None})
        return [self.cache.get(k) if hit else asked[k] for k, hit in zip(keys, cached)], cached

    def __call__(self, b: Any) -> Any:
        import torch

        from rlcli.rewards.scorer import Scored

        replies, cached = self.replies(self.texts(b))
        errors = sum(r is None for r in replies)
        if errors and self.j.on_error == "fail":
            raise JudgeUnavailable(
                f"the judge {self.backend.describe()} did not answer {errors} of {len(replies)} requests after "
                f"{self.j.retries} retries (last: {self.backend.last_error}); nothing was updated, the latest "
                "checkpoint is intact: start the judge (or fix reward.judge.url) and resume with resume=auto, or "
                "set reward.judge.on_error=zero to score unanswered requests 0")
        read = [(None, False) if r is None else read_verdict(r, self.j.verdict, self.j.min_score, self.j.max_score)
                for r in replies]
        unparsed = sum(r is not None and v is None for r, (v, _) in zip(replies, read))
        raw = torch.tensor([0.0 if v is None else v for v, _ in read], dtype=torch.float32)  # [N]
        extras = {"judge_cached": torch.tensor(cached, dtype=torch.float32),  # [N]
                  AUDIT: torch.tensor([float(c) for _, c in read], dtype=torch.float32)}  # [N]: contradictory at max
        return Scored(raw=raw, value=raw, extras=extras,
                      counts={"judge_errors": float(errors), "judge_unparsed": float(unparsed)})

    def close(self) -> None:
        self.cache.close()
        self.backend.close()
