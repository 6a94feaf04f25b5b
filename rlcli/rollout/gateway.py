"""The gateway: an OpenAI-compatible HTTP server on 127.0.0.1, answered by the run's own policy, that records
every episode token for token (rollout.agent; docs/environments.md, "Agents").

Routes, per episode under /e/<episode>/v1 (each episode's client has its own base URL), and /v1/models at the root:

    GET  /v1/models              the one model, "policy"
    POST /v1/chat/completions    messages (+ tools) -> one assistant message (tool_calls parsed with env.tool_format)
    POST /v1/completions         prompt (text or token ids) -> one continuation

An episode's record is one multi-turn row under the token contract of rlcli.envs.chat:

    prompt ⊕ sampled₁ ⊕ observation₁ ⊕ sampled₂ ⊕ ...

- the first request's prompt: its messages rendered with env.template (or its text encoded, or its token ids);
- each sampled part: the engine's token ids and log-probs as sampled, never decoded and encoded again;
- each observation: what the next request adds after the conversation so far (chat: the template's text after
  the last assistant turn's EOS, ChatFormat.observation_ids; text: the prompt's new suffix; token ids: as sent).
  Its tokens are read by the model and never trained (response_mask 0).

So a request must extend its episode's conversation: the messages (roles and contents; an assistant turn may come
back with its content left out) or the text so far, as the gateway returned them, then new ones. One that does not,
one sent while another of the episode is in flight, or one asking for n > 1 completions, is refused (HTTP 400/409):
the agent sees an error, and its episode scores 0. `stream=true` is answered with the whole completion as
server-sent events (one content chunk, then the finish reason, then the usage if asked).

A turn that stops without EOS (its max_tokens, the episode's budget rollout.max_new_tokens, counted over sampled
and observation tokens as in multi-turn rollout), or an episode past env.max_turns requests, ends the record
(`truncated`); later requests get an empty reply with finish_reason "length". Sampling is the run's (rollout.* or
eval.*): a request's temperature, top_p or seed are ignored, since training reads the run's sampler's log-probs.

Threads: the HTTP server answers each connection on a thread of its own; a request waits in a queue until the
thread that owns the engine (the training process's main thread) takes every waiting request as one batch
(`serve`) and answers them: all that wait, and those that follow each other within linger_s.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlcli.envs.agent import MODEL_NAME
from rlcli.envs.chat import ChatFormat, Message, TemplateError
from rlcli.envs.tools import TOOL_FORMATS
from rlcli.rollout.multiturn import Trajectory
from rlcli.rollout.sampling import Sampling


class Refused(Exception):
    """A request the gateway does not serve: HTTP `status` with `message`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Episode(Trajectory):
    """One episode's record (a Trajectory: prompt, ids, trained, logp, truncated, stats) and its conversation."""

    budget: int = 0  # tokens the row may hold after the prompt (rollout.max_new_tokens)
    kind: str | None = None  # "chat" | "text", set by the first request
    tools: list[dict] | None = None
    chat: ChatFormat | None = None
    text: str = ""  # the text so far (kind "text")
    busy: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class Request:
    episode: Episode
    context: list[int]  # what the model reads: prompt ⊕ ids ⊕ observation
    observation: list[int]
    budget: int
    messages: list[Message] = field(default_factory=list)  # chat: the new messages
    suffix: str = ""  # text: the new text
    done: threading.Event = field(default_factory=threading.Event)
    reply: tuple[list[int], list[float]] | None = None


def plain_content(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise Refused(400, "message content must be text (a string, or parts of type 'text')")


def conversation(messages: Any) -> list[Message]:
    """Request messages -> chat messages for the template (role, content, and a tool message's name)."""
    if not isinstance(messages, list) or not messages:
        raise Refused(400, "'messages' must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Refused(400, "each message needs a 'role'")
        out.append({"role": m["role"], "content": plain_content(m.get("content"))}
                   | ({"name": str(m["name"])} if m.get("name") else {}))
    return out


def same_turn(sent: Message, recorded: Message) -> bool:
    """Whether a message of a request is the record's: the same role and content, or an assistant turn sent back
    with its content left out (clients that echo a tool-calling turn as its tool_calls alone)."""
    return sent["role"] == recorded["role"] and (
        sent["content"] == recorded["content"] or (sent["role"] == "assistant" and not sent["content"]))


def tool_calls(text: str, tools: list[dict] | None, tool_format: str) -> list[dict]:
    """The calls written in `text` (env.tool_format) of the request's tools, in OpenAI's format."""
    if not tools:
        return []
    functions = {t["function"]["name"]: t["function"] for t in tools if isinstance(t, dict) and "function" in t}
    out = []
    calls = [c for c in TOOL_FORMATS[tool_format](text, set(functions)) if c.name in functions]  # not bad JSON
    for k, call in enumerate(calls):
        arguments = dict(call.kwargs)
        if call.args:  # compact: name(argument) -> the first parameter
            first = next(iter(functions[call.name].get("parameters", {}).get("properties", {})), "input")
            arguments[first] = call.args[0]
        out.append({"id": f"call_{k}", "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(arguments)}})
    return out


class Gateway:
    """The HTTP server and the episodes' records (module doc). `open(n)` makes n episodes and their URLs;
    `serve(engine, sampling, finished)` answers requests until `finished` is set and no request waits."""

    def __init__(self, tokenizer: Any, env_cfg: Any, max_batch: int, linger_s: float = 0.05):
        self.tokenizer, self.cfg = tokenizer, env_cfg
        self.max_batch, self.linger_s = max_batch, linger_s
        self.episodes: dict[int, Episode] = {}
        self.ids = itertools.count()
        self.pending: queue.Queue[Request] = queue.Queue()
        self.tokens = threading.Lock()  # a fast tokenizer is not to be used from several threads at once
        self.formats: dict[str, ChatFormat] = {}  # by the tools' JSON: ChatFormat checks its template once
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="rlcli-gateway", daemon=True)
        self.thread.start()

    # -- the episodes ------------------------------------------------------------------------------------------

    def open(self, n: int, budget: int) -> list[tuple[Episode, str]]:
        """n fresh episodes, each with its base URL; `budget` = tokens an episode's row may hold."""
        out = []
        for _ in range(n):
            i = next(self.ids)
            self.episodes[i] = Episode(env=None, messages=[], prompt=[], budget=budget)
            out.append((self.episodes[i], f"{self.url}/e/{i}/v1"))
        return out

    def close(self, episodes: list[Episode]) -> None:
        """Stop recording `episodes`: their later requests are refused (410), waiting ones answered so."""
        for e in episodes:
            with e.lock:
                e.closed = True
        for i in [i for i, e in self.episodes.items() if e.closed]:
            del self.episodes[i]

    # -- the engine's side (the thread that owns it) -----------------------------------------------------------

    def serve(self, engine: Any, sampling: Sampling, finished: threading.Event) -> None:
        """Answer waiting requests in batches (all that wait, up to max_batch, after a first one and linger_s)
        until `finished` is set and the queue is empty."""
        while True:
            batch = self.take()
            if batch:
                self.answer(engine, sampling, batch)
            elif finished.is_set():
                return

    def take(self) -> list[Request]:
        """The waiting requests: after a first one, more until none has come for linger_s, or max_batch of them
        (episodes start, and come back from their tools, a little apart)."""
        try:
            batch = [self.pending.get(timeout=0.05)]
        except queue.Empty:
            return []
        while len(batch) < self.max_batch:
            try:
                batch.append(self.pending.get(timeout=self.linger_s))
            except queue.Empty:
                break
        return batch

    def answer(self, engine: Any, sampling: Sampling, batch: list[Request]) -> None:
        live = [r for r in batch if not r.episode.closed]
        for r in batch:
            if r.episode.closed:
                r.done.set()  # the handler answers 410
        if not live:
            return
        outs = engine.continue_tokens([r.context for r in live], [r.budget for r in live], sampling, True)
        eos = self.tokenizer.eos_token_id
        for r, (new, logp) in zip(live, outs):
            e = r.episode
            with e.lock, self.tokens:
                e.add(r.observation, None, trained=False)
                e.stats["observation_tokens"] += len(r.observation)
                e.add(new, logp, trained=True)
                e.stats["turns"] += 1
                text = self.tokenizer.decode(new, skip_special_tokens=True)
                if e.kind == "chat":
                    e.messages += r.messages + [{"role": "assistant", "content": text}]
                else:
                    e.text += r.suffix + text
                if not new or new[-1] != eos:
                    e.truncated = e.done = True  # the record ends here (module doc)
                r.reply = (new, logp or [0.0] * len(new))
            r.done.set()

    # -- the request's side (an HTTP thread) -------------------------------------------------------------------

    def request(self, episode_id: int, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """One completion request of an episode -> the response body (Refused on a request not served)."""
        if body.get("n", 1) != 1:
            raise Refused(400, "n must be 1: rlcli samples the group itself (rollout.n episodes per row)")
        e = self.episodes.get(episode_id)
        if e is None or e.closed:
            raise Refused(410, f"episode {episode_id} is over")
        with e.lock, self.tokens:
            if e.busy:
                raise Refused(409, "one request at a time per episode")
            r = self.chat_request(e, body) if route == "chat/completions" else self.text_request(e, body)
            if r is not None:
                e.busy = True
        if r is not None:
            self.pending.put(r)
            answered = r.done.wait(self.cfg.episode_timeout_s)  # the engine's thread gone: the agent hears of it
            with e.lock:
                e.busy = False
            if not answered:
                raise Refused(504, f"no completion within env.episode_timeout_s={self.cfg.episode_timeout_s:g} s")
            if r.reply is None:
                raise Refused(410, f"episode {episode_id} is over")
        new, logp = r.reply if r is not None else ([], [])  # none: the record has ended, an empty reply
        finish = "stop" if new and new[-1] == self.tokenizer.eos_token_id else "length"
        with self.tokens:
            return self.response(route, e, new, logp, body, finish)

    def limit(self, e: Episode, body: dict[str, Any], observation: list[int]) -> int:
        """Tokens this turn may sample: the request's max_tokens within the episode's budget. 0 = none: the record
        ends, `truncated` when the budget ran out (not after env.max_turns turns, as in multi-turn rollout)."""
        asked = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), e.budget)
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
            raise Refused(400, f"max_tokens must be a positive integer, got {asked!r}")
        if e.done or e.stats["turns"] >= self.cfg.max_turns:
            e.done = True
            return 0
        left = e.budget - len(e.ids) - len(observation)
        if left <= 0:
            e.done = e.truncated = True
        return max(0, min(left, asked))

    def chat_request(self, e: Episode, body: dict[str, Any]) -> Request | None:
        messages = conversation(body.get("messages"))
        if e.kind is None:
            key = json.dumps(body.get("tools"), sort_keys=True)
            try:
                e.chat = self.formats.get(key) or ChatFormat(self.tokenizer, self.cfg.template, body.get("tools"))
            except TemplateError as err:
                raise Refused(400, str(err)) from None
            self.formats[key] = e.chat
            e.kind, e.tools, e.prompt = "chat", body.get("tools"), e.chat.prompt_ids(messages)
            new, observation = messages, []
        else:
            if e.kind != "chat":
                raise Refused(400, "this episode began with /v1/completions; it cannot go on with chat messages")
            if body.get("tools") != e.tools:
                raise Refused(400, "the tools changed within the episode")
            n = len(e.messages)
            if len(messages) <= n or not all(map(same_turn, messages[:n], e.messages)):
                raise Refused(400, "the messages must repeat the episode's conversation as the gateway returned it "
                                   "(roles and contents), then add new ones")
            new = messages[n:]
            try:
                observation = e.chat.observation_ids(e.messages, new)
            except TemplateError as err:
                raise Refused(400, str(err)) from None
        budget = self.limit(e, body, observation)
        if budget == 0:
            return None
        return Request(e, e.prompt + e.ids + observation, observation, budget, messages=new)

    def text_request(self, e: Episode, body: dict[str, Any]) -> Request | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        tokens = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) or tokens) or not prompt:
            raise Refused(400, "'prompt' must be one non-empty string or one list of token ids")
        if e.kind is None:
            e.kind = "text"
            e.prompt = list(prompt) if tokens else self.tokenizer.encode(prompt, add_special_tokens=False)
            e.text = "" if tokens else prompt
            observation, suffix = [], ""
        elif e.kind != "text":
            raise Refused(400, "this episode began with /v1/chat/completions; it cannot go on with a text prompt")
        elif tokens:
            so_far = e.prompt + e.ids
            if prompt[: len(so_far)] != so_far or len(prompt) == len(so_far):
                raise Refused(400, "the prompt's token ids must extend the episode's tokens so far")
            observation, suffix = list(prompt[len(so_far) :]), self.tokenizer.decode(prompt[len(so_far) :])
        else:
            if not prompt.startswith(e.text) or len(prompt) == len(e.text) or not e.text:
                raise Refused(400, "the prompt must extend the episode's text so far (its prompt and the gateway's "
                                   "completions, as returned)")
            suffix = prompt[len(e.text) :]
            observation = self.tokenizer.encode(suffix, add_special_tokens=False)
        budget = self.limit(e, body, observation)
        if budget == 0:
            return None
        return Request(e, e.prompt + e.ids + observation, observation, budget, suffix=suffix)

    def response(self, route: str, e: Episode, new: list[int], logp: list[float], body: dict[str, Any],
                 finish: str) -> dict[str, Any]:
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        usage = {"prompt_tokens": len(e.prompt) + len(e.ids) - len(new), "completion_tokens": len(new),
                 "total_tokens": len(e.prompt) + len(e.ids)}
        head = {"id": f"rlcli-{time.monotonic_ns()}", "created": int(time.time()), "model": MODEL_NAME, "usage": usage}
        pieces = [self.tokenizer.decode([t]) for t in new]
        if route == "completions":
            choice = {"index": 0, "text": text, "finish_reason": finish,
                      "logprobs": {"tokens": pieces, "token_logprobs": logp} if body.get("logprobs") else None}
            return head | {"object": "text_completion", "choices": [choice]}
        calls = tool_calls(text, e.tools, self.cfg.tool_format)
        message = {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})
        content = [{"token": p, "logprob": lp, "top_logprobs": []} for p, lp in zip(pieces, logp)]
        choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
                  "logprobs": {"content": content} if body.get("logprobs") else None}
        return head | {"object": "chat.completion", "choices": [choice]}

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def stream_events(response: dict[str, Any], body: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole completion as the server-sent events of `stream=true`: the content (and tool calls) in one chunk, the
    finish reason in the next, the usage in a last one when stream_options.include_usage asks for it."""
    choice = response["choices"][0]
    head = {k: response[k] for k in ("id", "created", "model")}
    if response["object"] == "text_completion":
        chunks = [{"index": 0, "text": choice["text"], "logprobs": choice["logprobs"], "finish_reason": None},
                  {"index": 0, "text": "", "finish_reason": choice["finish_reason"]}]
        kind = "text_completion"
    else:
        message = choice["message"]
        delta = {"role": "assistant", "content": message["content"]} | (
            {"tool_calls": [{"index": k} | c for k, c in enumerate(message["tool_calls"])]} if "tool_calls" in message else {})
        chunks = [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None},
                  {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]
        kind = "chat.completion.chunk"
    events = [head | {"object": kind, "choices": [c]} for c in chunks]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(head | {"object": kind, "choices": [], "usage": response["usage"]})
    return events


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: every episode of a step may connect at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (an agent interrupted or killed) is no error of the server's: no traceback."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(gateway: Gateway) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # no access log on stderr
            pass

        def send_json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def send_events(self, events: list[dict[str, Any]]) -> None:
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def route(self) -> tuple[int | None, str]:
            parts = self.path.split("?")[0].strip("/").split("/")
            if len(parts) >= 3 and parts[0] == "e" and parts[1].isdigit():
                return int(parts[1]), "/".join(parts[2:])
            return None, "/".join(parts)

        def do_GET(self) -> None:
            _, route = self.route()
            if route == "v1/models":
                self.send_json(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "rlcli"}]})
            else:
                self.send_json(404, {"error": {"message": f"no route GET /{route}"}})

        def do_POST(self) -> None:
            episode, route = self.route()
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if route not in ("v1/chat/completions", "v1/completions") or episode is None:
                    raise Refused(404, f"no route POST /{route} (per episode: /e/<episode>/v1/...)")
                if not isinstance(body, dict):
                    raise Refused(400, "the body must be a JSON object")
                response = gateway.request(episode, route.removeprefix("v1/"), body)
                if body.get("stream"):
                    self.send_events(stream_events(response, body))
                else:
                    self.send_json(200, response)
            except Refused as err:
                self.send_json(err.status, {"error": {"message": str(err), "type": "invalid_request_error"}})
            except json.JSONDecodeError as err:
                self.send_json(400, {"error": {"message": f"invalid JSON: {err}"}})
            except ConnectionError:
                raise
            except Exception as err:  # the template failed on these messages, say: the agent sees why
                self.send_json(500, {"error": {"message": f"{type(err).__name__}: {err}"}})

    return Handler
