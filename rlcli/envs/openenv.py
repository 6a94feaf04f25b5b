"""OpenEnv environments (env=openenv; docs/environments.md, "OpenEnv"): an OpenEnv server is the environment of
multi-turn rollout, reached through openenv-core's client (`pip install 'rlcli[openenv]'`, imported only here and
only when env=openenv is used).

One episode is one trajectory of MultiTurn (rlcli.rollout.multiturn) and one WebSocket connection to the server,
which keeps that episode's environment instance:

    reset(row)      connect, reset (with the row's prompt and answer as keyword arguments, which the server passes
                    on only to a reset that accepts them) -> [env.system_prompt], the observation as a user message
    step(message)   the policy's text as an action (a JSON object that fits the action schema, else the text in the
                    schema's one required string field) -> the observation as a user message, the step's reward, done
    close()         the connection closed (MultiTurn calls it when the trajectory ends, however it ends)

An episode whose reset or step fails (the server raises, refuses the action, or is gone) ends there and counts in
env/errors; one whose call outlasts env.openenv.step_timeout_s, or whose calls together outlast
env.openenv.episode_timeout_s, counts in env/timeouts. Either way it scores 0 (RewardManager.reward_batch) and the
run goes on. The client runs on one event loop thread shared by every episode of this process, so a call that hangs
is abandoned after its timeout, not waited for.

env.openenv.app=module:app is served by rlcli on 127.0.0.1 in a subprocess of its own for the run (started on the
first episode, stopped by MultiTurn.close through `OpenEnvEnvironment.shutdown`): a subprocess, not a thread, so an
environment that crashes, leaks or holds the GIL cannot take the trainer with it, and a server that dies is served
again for the next episodes. The listening socket is bound here and handed to the child, so no port can be taken in
between.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from rlcli.core.schema import ConfigError, rng
from rlcli.envs.chat import Message
from rlcli.envs.env import StepResult

log = logging.getLogger(__name__)

OPENENV = "rlcli.envs.openenv.OpenEnvEnvironment"
"""env.name of env=openenv (conf/env/openenv.yaml)."""
EXTRA = "pip install 'rlcli[openenv]'"


@dataclass
class OpenEnvConfig:
    """env.openenv.*: the OpenEnv server of env=openenv, and the bounds on its episodes (docs/environments.md)."""

    url: str | None = None
    """A running OpenEnv server, http://HOST:PORT (its /schema must answer before any model loads); or null with
    env.openenv.app."""
    app: str | None = None
    """An OpenEnv app (openenv-core's create_app(...)) as module:attribute, which rlcli serves on 127.0.0.1 in a
    subprocess for the run (started again if it dies); or null with env.openenv.url."""
    step_timeout_s: float = rng(30.0, gt=0)
    """Each reset or step: a call that has not answered by then ends its episode (it scores 0, counted in
    env/timeouts)."""
    episode_timeout_s: float = rng(300.0, gt=0)
    """One episode's reset and steps together (the environment's time, not the policy's): past it, the episode
    ends as a timeout. The turns are bounded by env.max_turns."""
    startup_timeout_s: float = rng(120.0, gt=0)
    """env.openenv.app: seconds the served app has to answer /health after its process starts (importing
    openenv-core alone takes ~5 s)."""
    pass_row: bool = True
    """Pass the data row's prompt and answer to the server's reset as keyword arguments `prompt` and `answer` (a
    reset that does not take them never sees them); false = reset with no arguments."""
    action_key: str | None = None
    """The action field the policy's text goes into when it is not a JSON action; null = the action schema's one
    required string field."""
    observation_key: str | None = None
    """The observation field shown to the policy; null = the only non-empty field if it is text, else the non-empty
    fields as JSON."""


# ------------------------------------------------------------------------------------------------ config checks


def check_config(e: Any) -> None:
    """env=openenv's rules, before any model loads (rlcli.config.rules.validate_env): the extra is installed, one server
    is named, its app imports or its URL answers."""
    o = e.openenv
    if e.name != OPENENV:
        for key in ("url", "app"):
            if getattr(o, key) is not None:
                raise ConfigError(f"env.openenv.{key}={getattr(o, key)} is read by env=openenv only, but env.name={e.name}: "
                                  "add env=openenv (or drop it)")
        return
    try:
        import openenv  # noqa: F401  (the package's face only: openenv.core, ~5 s, is imported by the app or client)
    except ImportError:
        raise ConfigError(f"env=openenv needs openenv-core: {EXTRA}") from None
    if o.url is not None and o.app is not None:
        raise ConfigError(f"env.openenv.url={o.url} and env.openenv.app={o.app} name two servers: keep one")
    if o.url is None and o.app is None:
        raise ConfigError("env=openenv needs its server: env.openenv.app=module:app (rlcli serves it on 127.0.0.1, "
                          "e.g. rlcli.envs.openenv_example:app) or env.openenv.url=http://HOST:PORT (a running one)")
    if o.app is not None:
        try:
            load_app(o.app)
        except Exception as err:  # the user's module may raise anything while it imports
            raise ConfigError(f"env.openenv.app={o.app} cannot be imported ({type(err).__name__}: {err}): name an "
                              "OpenEnv app as module:attribute, importable here, e.g. "
                              "rlcli.envs.openenv_example:app") from None
        return
    if not re.match(r"https?://", o.url):
        raise ConfigError(f"env.openenv.url={o.url} must be http://HOST:PORT (or https://)")
    try:
        action_schema(o.url, timeout_s=5.0)
    except Exception as err:
        raise ConfigError(f"env.openenv.url={o.url} does not answer as an OpenEnv server ({type(err).__name__}: "
                          f"{err}): start it first, or let rlcli serve it with env.openenv.app=module:app") from None


def load_app(spec: str) -> Any:
    """The ASGI app `module:attribute` names (ImportError, AttributeError, ValueError, or the module's own error)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError("expected module:attribute")
    app = getattr(importlib.import_module(module), attr)
    if not callable(app):
        raise TypeError(f"{attr} is a {type(app).__name__}, not an ASGI app")
    return app


def http_get(url: str, timeout_s: float) -> bytes:
    """GET `url`; a loopback address never through a proxy (HTTP_PROXY and the like are for the outside)."""
    host = urllib.parse.urlsplit(url).hostname
    handlers = [urllib.request.ProxyHandler({})] if host in ("127.0.0.1", "localhost", "::1") else []
    with urllib.request.build_opener(*handlers).open(url, timeout=timeout_s) as r:
        return r.read()


_SCHEMAS: dict[str, dict] = {}


def action_schema(url: str, timeout_s: float) -> dict:
    """The server's action JSON schema (GET /schema; kept per URL)."""
    if url not in _SCHEMAS:
        _SCHEMAS[url] = json.loads(http_get(url.rstrip("/") + "/schema", timeout_s))["action"]
    return _SCHEMAS[url]


# ------------------------------------------------------------------------------------------------ text <-> env


class BadAction(ValueError):
    """The policy's text is no action of this environment."""


def text_field(schema: dict, key: str | None) -> str | None:
    """The action field plain text goes into: `key`, else the schema's one required string field (None if none)."""
    if key is not None:
        return key
    props, required = schema.get("properties", {}), schema.get("required", [])
    if len(required) == 1 and props.get(required[0], {}).get("type", "string") == "string":
        return required[0]
    return None


def parse_action(text: str, schema: dict, key: str | None = None) -> dict:
    """The action of the policy's `text`: a JSON object (fenced or not) whose keys are the schema's properties and
    include its required ones, else {text field: text} (BadAction if the schema has no such field)."""
    text = text.strip()
    fenced = re.fullmatch(r"```[a-z]*\s*\n(.*?)\n?```", text, re.S)
    body = fenced.group(1).strip() if fenced else text
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    props, required = schema.get("properties", {}), schema.get("required", [])
    if isinstance(value, dict) and value and set(value) <= set(props) and set(required) <= set(value):
        return value
    field = text_field(schema, key)
    if field is None:
        raise BadAction(f"not a JSON action with the fields {sorted(required)}, and the action schema has no one "
                        "required string field for text (env.openenv.action_key names one)")
    return {field: text}


def observation_text(observation: dict, key: str | None = None) -> str:
    """What the policy reads of an observation (its fields but reward, done and metadata, as the server sends it)."""
    if key is not None:
        if key not in observation:
            raise KeyError(f"the observation has no field {key!r} (env.openenv.observation_key); it has "
                           f"{sorted(observation)}")
        value = observation[key]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    shown = {k: v for k, v in observation.items() if v not in (None, "", [], {})}
    if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
        return next(iter(shown.values()))
    return json.dumps(shown, ensure_ascii=False) if shown else ""


# ------------------------------------------------------------------------------------------------ the client's loop


class _Loop:
    """One event loop on a daemon thread for every client of this process: calls run there with a deadline, and a
    call past it is cancelled (the trainer never waits on a hung server longer than its timeout)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rlcli-openenv", daemon=True).start()
        self.closing: list[concurrent.futures.Future] = []

    def run(self, coro: Any, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=max(timeout_s, 0.0))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout_s:.1f} s") from None

    def close_later(self, coro: Any) -> None:
        self.closing.append(asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, 5.0), self.loop))

    def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (at most `timeout_s`) for the connections closed so far, so their slots on the server are free."""
        concurrent.futures.wait(self.closing, timeout=timeout_s)
        self.closing = [f for f in self.closing if not f.done()]


_LOOP: _Loop | None = None
_LOCK = threading.Lock()


def client_loop() -> _Loop:
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = _Loop()
        return _LOOP


# ------------------------------------------------------------------------------------------------ serving an app


class Server:
    """env.openenv.app served on 127.0.0.1 by a child process (`python -m rlcli.envs.openenv`), its output kept in a
    temporary file for the error messages."""

    def __init__(self, app: str, startup_timeout_s: float):
        self.app, self.startup_timeout_s = app, startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url, self.started = "", 0.0

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        self.url, self.started = f"http://127.0.0.1:{sock.getsockname()[1]}", time.monotonic()
        self.output = tempfile.TemporaryFile()  # noqa: SIM115 (open while the server runs; stop() closes it)
        path = os.pathsep.join([os.getcwd(), *(p for p in sys.path if p)])  # the app imports there as it does here
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlcli.envs.openenv", self.app, str(sock.fileno()), str(os.getpid())],
                pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL, stdout=self.output, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": path},
                start_new_session=True)  # a Ctrl-C stops the trainer after its step, not the server within it
        finally:
            sock.close()  # the child holds it now
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"env.openenv.app={self.app}: its server exited with code {self.proc.returncode} "
                                   f"while starting: {self.tail()}")
            try:
                http_get(self.url + "/health", 1.0)
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"env.openenv.app={self.app}: its server did not answer within "
                                   f"env.openenv.startup_timeout_s={self.startup_timeout_s}: {tail}")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, chars: int = 600) -> str:
        if self.output.closed:
            return "(no output kept)"
        self.output.seek(0)
        text = self.output.read().decode(errors="replace").strip()
        return " | ".join(text[-chars:].splitlines()) or "(no output)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.output.close()


_SERVERS: dict[str, Server] = {}
_RESTART_GAP_S = 5.0
"""A served app that died is started again at most this often (not once per episode of a batch)."""


class ServeError(RuntimeError):
    """The app could not be served at the start of the run: nothing could run, so the run stops with this."""


def endpoint(o: Any) -> str:
    """The URL of env.openenv's server: env.openenv.url, or the app served here (started on first use; started again
    if it died since, with a warning, or ConnectionError while it cannot be)."""
    if o.url is not None:
        return o.url.rstrip("/")
    server = _SERVERS.get(o.app)
    if server is None:
        server = Server(o.app, o.startup_timeout_s)
        try:
            server.start()
        except RuntimeError as err:
            raise ServeError(str(err)) from None
        _SERVERS[o.app] = server
    elif not server.alive():
        code = server.proc.returncode if server.proc is not None else None
        if time.monotonic() - server.started < _RESTART_GAP_S:
            raise ConnectionError(f"the server of env.openenv.app={o.app} is down (exit code {code})")
        log.warning("env.openenv.app=%s: its server exited (code %s); serving it again. Its output: %s", o.app, code,
                    server.tail())
        server.stop()
        server.start()
    return server.url


def shutdown() -> None:
    """Stop every app served by this process."""
    for app in list(_SERVERS):
        _SERVERS.pop(app).stop()


def serve(app: str, fd: int, parent: int) -> None:
    """The child's side of Server: `app` on the listening socket `fd` until told to stop or until `parent` is gone."""
    import uvicorn

    sock = socket.socket(fileno=fd)
    asgi = load_app(app)

    def orphaned() -> None:  # the trainer was killed without stopping us
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    uvicorn.Server(uvicorn.Config(asgi, log_level="warning", timeout_graceful_shutdown=1)).run(sockets=[sock])
    os._exit(0)  # without waiting for a step still hanging in one of the app's executor threads


# ------------------------------------------------------------------------------------------------ the environment

_LOGGED: set[tuple[str, bool]] = set()


def _log_once(kind: str, message: str) -> None:
    # A server at capacity sends CAPACITY_REACHED and closes the connection: the client sees one or the other
    full = "CAPACITY_REACHED" in message or (kind.endswith("reset") and "ConnectionClosedOK" in message)
    if (kind, full) not in _LOGGED:
        _LOGGED.add((kind, full))
        hint = (" (the server refused the connection: it may take fewer connections at once than this rank's "
                "episodes, rollout.prompts_per_step x rollout.n: create its app with a larger max_concurrent_envs)"
                ) if full else ""
        log.warning("env=openenv: an episode %s: %s%s (further ones are only counted: env/errors, env/timeouts)",
                    kind, message[:300], hint)


class OpenEnvEnvironment:
    """env=openenv: one episode on env.openenv's server (module doc); built by MultiTurn as cls(env_cfg, toolbox)."""

    def __init__(self, cfg: Any, toolbox: Any = None):
        self.cfg, self.o = cfg, cfg.openenv
        self.client: Any = None
        self.failed: str | None = None  # "errors" or "timeouts" once the episode has failed
        self.spent = 0.0  # seconds of the environment's calls so far (env.openenv.episode_timeout_s)

    def reset(self, row: dict[str, str]) -> list[Message]:
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        loop = client_loop()
        loop.drain()
        try:
            self.url = endpoint(self.o)
            self.schema = action_schema(self.url, self.o.step_timeout_s)
            self.client = new_client(self.url, self.o)
            kwargs = {"prompt": row["prompt"], "answer": row["answer"]} if self.o.pass_row else {}
            result = self.call(self.client.reset(**kwargs))
            return system + [{"role": "user", "content": observation_text(result.observation, self.o.observation_key)}]
        except ServeError:
            raise
        except Exception as err:
            self.fail(err, "reset")
            return system + [{"role": "user", "content": row["prompt"]}]  # read once; the first step ends it

    def step(self, message: str) -> StepResult:
        if self.failed is not None:  # the reset failed
            return StepResult([], done=True, info={self.failed: 1.0})
        try:
            action = parse_action(message, self.schema, self.o.action_key)
            result = self.call(self.client.step(action))
            text = observation_text(result.observation, self.o.observation_key)[: self.cfg.max_observation_chars]
            reward = float(result.reward or 0.0)
        except Exception as err:
            self.fail(err, "step")
            return StepResult([], done=True, info={self.failed: 1.0})
        if result.done:
            self.close()
        return StepResult([{"role": "user", "content": text}], reward=reward, done=bool(result.done))

    def call(self, coro: Any) -> Any:
        """`coro` on the client's loop within the step's and the episode's time left."""
        start = time.monotonic()
        try:
            return client_loop().run(coro, min(self.o.step_timeout_s, self.o.episode_timeout_s - self.spent))
        finally:
            self.spent += time.monotonic() - start

    def fail(self, err: BaseException, where: str) -> None:
        self.failed = "timeouts" if isinstance(err, TimeoutError) else "errors"
        what = "timed out" if self.failed == "timeouts" else "failed"
        _log_once(f"{what} in {where}", f"{type(err).__name__}: {err}")
        self.close()

    def close(self) -> None:
        """Close this episode's connection (without waiting: a dead or hung server must not hold the rollout)."""
        if self.client is not None:
            client_loop().close_later(self.client.disconnect())
            self.client = None

    @classmethod
    def shutdown(cls) -> None:
        """The run is over (MultiTurn.close): stop the app served for it."""
        shutdown()


def new_client(url: str, o: Any) -> Any:
    """openenv-core's dict client on `url`; our loop enforces the timeouts, so its own are the loosest."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as err:
        raise RuntimeError(f"env=openenv needs openenv-core ({err}): {EXTRA}") from None
    return GenericEnvClient(base_url=url, connect_timeout_s=o.step_timeout_s, message_timeout_s=o.episode_timeout_s)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
