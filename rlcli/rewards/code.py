"""Code rewards (reward=code): a response's program run against its task's tests in a sandbox.

    execute(program, tests, timeout_s=5.0, prefix=..., entry_point=...) -> CodeResult  # assert style (HumanEval, MBPP)
    execute_stdio(program, cases, timeout_s=5.0) -> CodeResult                        # stdin/stdout (competitive)

The ground truth of a code task (its data row's answer column) is JSON, `{"assert": TESTS, "prefix": CODE,
"entry_point": NAME}` or `{"stdio": [[STDIN, STDOUT], ...]}` (rlcli.data.code_tasks builds both). Assert style: each
top-level `assert` statement and each top-level bare call (`check(candidate)`) of TESTS is one test, run in order;
other top-level statements are set-up. Stdin/stdout style: each case runs the program afresh with STDIN and compares
its output to STDOUT, line by line with trailing spaces stripped.

The verdict is decided here, where the program cannot reach it. The program runs in the sandbox (the files of
rlcli/rewards/sandbox/) and only answers. Assert style: the task's tests (and the prefix's helpers: dataset code,
trusted as the data is) run in this process, which never runs program code, with the function under test bound to
a proxy; a call goes to the sandbox as data (sandbox/wire.py), the program's function runs there, and its result
comes back as plain built-in values (or the name of the exception it raised) for the test's own assert to compare.
Stdin/stdout style: the sandbox gets the stdins only and sends back each run's stdout and exit status. Expected
values never enter the sandbox, and only this side counts: `ok` is "every test counted here passed". A sandbox that
dies, runs past its time, passes its output cap or answers something malformed ends the execution there, with the
tests that really passed before it. docs/code_rewards.md.

The sandbox (Linux), for every execution:
- namespaces (`unshare`): a user namespace, a network namespace (no interface but a loopback that is down: no
  network at all), a PID namespace (launcher.py is PID 1; when it exits the kernel kills every process left in it,
  so a daemonised grandchild dies with it), a mount namespace in which every mount is remounted read-only except
  the execution's own fresh working directory;
- run as an unprivileged user (nobody, 65534) when the trainer is root: RLIMIT_NPROC binds only for a non-root
  user; limits on CPU seconds, address space, file size, processes and open files; no core files;
- a minimal environment: none of the trainer's variables (tokens, keys); `python -I` (no PYTHON* variables, no user
  site-packages, no working folder on sys.path);
- the whole process group killed at the wall-clock limit; output read with a cap (the program is killed when it
  passes it, status `output_limit`);
- the working directory removed afterwards.
What it does not protect against (a kernel exploit, files the sandbox's user can read) is written in
docs/code_rewards.md, with `reward.code.url` for an external sandbox service.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import importlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.data.code_tasks import doctest_checks
from rlcli.rewards.sandbox import wire

STATUSES = ("ok", "failed", "timeout", "crashed", "memory", "output_limit", "refused")
"""Outcomes of one execution: all tests passed | some failed | the wall-clock or CPU limit | the program raised,
exited or died before its tests ran to the end, or its sandbox answered something malformed | its memory limit |
it printed past the cap | not run (no sandbox, a malformed request)."""

NOBODY = 65534
OUTPUT_CAP = 64 * 1024  # bytes of the program's stdout + stderr kept; past it the program is killed
ANSWER_CAP = 4 << 20  # bytes of one message from the sandbox; past it the execution ends (output_limit)
START_S = 2.0  # wall clock on top of timeout_s for the sandbox's start-up (~0.1 s) and clean-up
FILE_SIZE_MB = 16
OPEN_FILES = 64
PROCESSES = 32  # per execution (RLIMIT_NPROC inside its own user namespace)
SANDBOX = Path(__file__).with_name("sandbox")
SANDBOX_FILES = ("launcher.py", "harness.py", "wire.py")


@dataclass
class CodeResult:
    """One execution: `passed` of `total` tests, and how it ended."""

    passed: int
    total: int
    status: str
    """One of STATUSES."""
    message: str = ""
    """Why, in one line, for statuses other than ok (the exception, the signal, the limit)."""
    output: str = ""
    """The program's stdout and stderr, at most OUTPUT_CAP bytes (decoded with errors replaced)."""
    seconds: float = 0.0
    audit_failed: bool = False
    """An `ok` execution whose task's visible examples (`visible`, run after the tests) did not all pass: the tests
    say pass, the examples the prompt shows say otherwise. False where the task shows none, or the execution is not
    ok."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    processes: int = PROCESSES
    file_size_mb: int = FILE_SIZE_MB
    open_files: int = OPEN_FILES


class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox (no unprivileged user namespaces, no unshare): the message says how."""


class ProgramError(Exception):
    """Raised into the tests where the program raised an exception that is not one of Python's own (their name and
    message come back, not the object), or returned a value wire.py cannot send."""


def _drop_to_nobody() -> bool:
    """Root of the machine (not of a user namespace that maps root alone): the sandbox then runs as nobody."""
    if os.geteuid() != 0:
        return False
    with open("/proc/self/uid_map") as f:
        return any(int(start) <= NOBODY < int(start) + int(n) for start, _, n in (line.split() for line in f))


@functools.lru_cache(maxsize=1)
def interpreter() -> str:
    """The Python that runs programs: this one's base interpreter, or /usr/bin/python3, the first one the sandbox's
    user can run; raises SandboxUnavailable (with the fix) when none can, or when namespaces are refused."""
    if shutil.which("unshare") is None:
        raise SandboxUnavailable("reward=code needs util-linux's `unshare` (apt install util-linux), or an external "
                                 "sandbox: reward.code.url=http://... (docs/code_rewards.md)")
    tried = []
    for python in dict.fromkeys([getattr(sys, "_base_executable", sys.executable), sys.executable, "/usr/bin/python3"]):
        if not os.path.exists(python):
            continue
        probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
                                "--mount-proc", python, "-I", "-c", "print('ok')"], capture_output=True, text=True,
                               timeout=30, **_user())
        if probe.stdout.strip() == "ok":
            return python
        tried.append(f"{python}: {(probe.stderr.strip().splitlines() or ['exit ' + str(probe.returncode)])[-1]}")
    raise SandboxUnavailable(
        "reward=code cannot start its sandbox here (" + "; ".join(tried) + "). It needs unprivileged user namespaces "
        "(`sysctl -w kernel.unprivileged_userns_clone=1`, or on Ubuntu 24.04+ "
        "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`) and a Python the user nobody can run when the "
        "trainer is root; or point rlcli at an external sandbox: reward.code.url=http://... (docs/code_rewards.md). "
        "It never runs code without one.")


def _user() -> dict[str, Any]:
    return dict(user=NOBODY, group=NOBODY, extra_groups=[]) if _drop_to_nobody() else {}


@functools.lru_cache(maxsize=1)
def _sandbox_files() -> dict[str, bytes]:
    return {name: (SANDBOX / name).read_bytes() for name in SANDBOX_FILES}


# ------------------------------------------------------------------------------------------------
# One sandbox, seen from the trainer.

class _Ended(BaseException):
    """The sandbox can answer no more: `status` (one of STATUSES) and why. A BaseException, so that a test's own
    `except Exception` does not swallow it."""

    def __init__(self, status: str, message: str):
        super().__init__(status, message)
        self.status, self.message = status, message


class _Sandbox:
    """An execution's sandbox process: launcher.py under `unshare`, harness.py inside it. Its stdout and stderr are
    drained up to OUTPUT_CAP; messages (wire.py) go out on one pipe and come back on another, each read and write
    waiting at most until the deadline (start + timeout_s + START_S). Once it has ended (died, timed out, passed a
    cap, said something malformed), `ended` says why and every call raises _Ended."""

    def __init__(self, python: str, work: str, style: str, limits: Limits):
        self.timeout_s = limits.timeout_s
        self.cpu = max(1, int(limits.timeout_s + 1))
        self.deadline = time.monotonic() + limits.timeout_s + START_S
        self.ended: _Ended | None = None
        self.buffer = bytearray()
        self.output = bytearray()
        self.over = threading.Event()
        caps = f"{self.cpu},{limits.memory_mb},{limits.processes},{limits.file_size_mb},{limits.open_files}"
        calls_r, self.calls = os.pipe()
        self.answers, answers_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--mount-proc",
                 "--kill-child", python, "-I", "-B", "-X", "utf8", os.path.join(work, "launcher.py"), work, caps,
                 style, str(limits.timeout_s), str(calls_r), str(answers_w)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(calls_r, answers_w),
                start_new_session=True, env={"PATH": "/usr/bin:/bin"}, **_user())
        except BaseException:
            for fd in (self.calls, self.answers):
                os.close(fd)
            raise
        finally:
            os.close(calls_r)
            os.close(answers_w)
        os.set_blocking(self.calls, False)
        self.drain = threading.Thread(target=self._drain, daemon=True)
        self.drain.start()

    def _drain(self) -> None:
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            room = OUTPUT_CAP - len(self.output)
            self.output += chunk[:max(room, 0)]
            if len(chunk) > room:
                self.over.set()
                _kill(self.proc)
                return

    def _wait(self, fd: int, event: int) -> None:
        """Until `fd` is ready for `event` (select.POLLIN, POLLOUT); the deadline ends the execution."""
        poll = select.poll()
        poll.register(fd, event)
        while not poll.poll(max(0.0, self.deadline - time.monotonic()) * 1000):
            if time.monotonic() >= self.deadline:
                self.end("timeout", f"ran past {self.timeout_s:g} s")

    def end(self, status: str, message: str) -> None:
        """Stop the sandbox for good and raise _Ended (output_limit wins: the kill came from passing the cap)."""
        if self.ended is None:
            _kill(self.proc)
            if self.over.is_set():
                status, message = "output_limit", f"output past {OUTPUT_CAP} bytes"
            self.ended = _Ended(status, message)
        raise self.ended

    def _exited(self) -> None:
        """The sandbox closed its end: why, from its exit status."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        code = self.proc.returncode or 0
        sig = code - 128 if code > 128 else -code if code < 0 else 0  # the launcher reports a signal as 128 + it
        if sig == signal.SIGXCPU:
            self.end("timeout", f"ran past its {self.cpu} CPU seconds")
        why = f"was killed by {signal.Signals(sig).name}" if sig > 0 else f"exited with status {code}"
        self.end("crashed", f"the program {why} before its tests ran to the end")

    def send(self, data: bytes) -> None:
        if self.ended:
            raise self.ended
        view = memoryview(data)
        while view:
            self._wait(self.calls, select.POLLOUT)
            try:
                view = view[os.write(self.calls, view):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                self._exited()

    def receive(self) -> dict[str, Any]:
        """The next message, parsed (wire.parse)."""
        if self.ended:
            raise self.ended
        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) > ANSWER_CAP:
                self.end("output_limit", f"a message from the sandbox past {ANSWER_CAP} bytes")
            self._wait(self.answers, select.POLLIN)
            chunk = os.read(self.answers, 1 << 16)
            if not chunk:
                self._exited()
            self.buffer += chunk
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        try:
            return wire.parse(line)
        except wire.Malformed as e:
            self.end("crashed", f"the sandbox answered something malformed ({e})")

    def expect(self, key: str, reply: dict[str, Any] | None = None) -> dict[str, Any]:
        """The next message (or `reply`, received already), which must carry `key`; a `fatal` one ends the execution
        with its status, any other the same as malformed."""
        reply = self.receive() if reply is None else reply
        if key in reply:
            return reply
        fatal = reply.get("fatal")
        if fatal in ("crashed", "memory", "timeout"):
            self.end(fatal, str(reply.get("message", ""))[:300])
        self.end("crashed", f"the sandbox answered something malformed (no {key!r}: {str(reply)[:80]})")

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        """The program's `name(*args, **kwargs)`, run in the sandbox: its value, or its exception raised here."""
        try:
            data = wire.message(call=name, args=wire.tag(list(args)), kwargs=wire.tag(kwargs))
        except wire.Unencodable as e:
            raise ProgramError(f"an argument of {name} cannot be sent to the program: {e}") from None
        self.send(data)
        reply = self.receive()
        if "answer" in reply:
            try:
                return wire.untag(reply["answer"])
            except wire.Malformed as e:
                self.end("crashed", f"the sandbox answered something malformed ({e})")
        if "raised" in reply:
            raise _mirror(str(reply["raised"]), str(reply.get("message", ""))[:300])
        if "unencodable" in reply:
            raise ProgramError(str(reply["unencodable"])[:300])
        return self.expect("answer", reply)  # fatal or malformed: ends

    def close(self, wait: bool = True) -> str:
        """Let the sandbox finish (it exits when the calls pipe closes; `wait`), kill what is left, and return its
        output. Once only; later calls return the output again."""
        if not self.proc.stdout.closed:
            os.close(self.calls)
            if wait and self.ended is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=max(0.0, min(1.0, self.deadline - time.monotonic())))
            _kill(self.proc)
            self.proc.wait()
            self.drain.join(timeout=5)
            os.close(self.answers)
            self.proc.stdout.close()
        return self.output.decode(errors="replace")


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group (unshare and PID 1 of its namespace; the rest die with PID 1)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _mirror(name: str, message: str) -> Exception:
    """The program's exception as the tests see it: Python's own class of that name, else ProgramError."""
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        with contextlib.suppress(Exception):
            return cls(message)  # some (UnicodeDecodeError) take other arguments: ProgramError then
    return ProgramError(f"{name}: {message}")


class _Proxy:
    """The program's function `name` as the tests see it: each call runs in the sandbox (_Sandbox.call)."""

    __slots__ = ("_box", "_name")

    def __init__(self, box: _Sandbox, name: str):
        self._box, self._name = box, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._box.call(self._name, args, kwargs)

    def __repr__(self) -> str:
        return f"<the program's {self._name}>"


@contextlib.contextmanager
def _sandbox(python: str, files: dict[str, str], style: str, limits: Limits):
    """A fresh working directory holding `files` and the sandbox's own, and the sandbox started on it; on exit the
    sandbox is stopped and the directory removed."""
    work = tempfile.mkdtemp(prefix="rlcli-code-")
    box = None
    try:
        for name, data in {**{n: t.encode() for n, t in files.items()}, **_sandbox_files()}.items():
            with open(os.path.join(work, name), "wb") as f:
                f.write(data)
        if _drop_to_nobody():
            for p in [work, *(os.path.join(work, n) for n in os.listdir(work))]:
                os.chown(p, NOBODY, NOBODY)
        box = _Sandbox(python, work, style, limits)
        yield box
    finally:
        if box is not None:
            box.close(wait=False)  # a no-op after the caller's close; at once on the way out of an exception
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# The tests' side.

def _is_test(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Assert) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call))


def _prefix_code(prefix: str) -> ast.Module:
    """The task's prefix as code this side can run for its helpers and imports: HumanEval's prompt (helpers, then
    the entry point's signature and docstring) parses as it is, a bare signature once given a body; of a prefix that
    does not parse either way, the import lines (or nothing)."""
    imports = "".join(line + "\n" for line in prefix.splitlines() if IMPORT.match(line))
    for text in (prefix, prefix + "    pass\n", imports):
        with contextlib.suppress(SyntaxError):
            return ast.parse(text)
    return ast.Module([], [])


def _free_names(tests: ast.Module, prefix: ast.Module) -> list[str]:
    """The names the tests load that neither they nor the prefix bind and that are not builtins: what they take from
    the program (`assert f(2) == 4` -> ["f"]), or a standard module the program imported for them (`math`)."""
    loaded, bound = set(), set(dir(builtins))
    for tree in (tests, prefix):
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                if not isinstance(node.ctx, ast.Load):
                    bound.add(node.id)
                elif tree is tests:
                    loaded.add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.alias):
                bound.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
    return sorted(loaded - bound)


def execute(program: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512, *, prefix: str = "",
            entry_point: str | None = None, visible: str | None = None) -> CodeResult:
    """Run `program` in a fresh sandbox and the assert-style `tests` here, against it. -> CodeResult.

    `prefix` (the task's, already part of `program` where it belongs) is run here too, for the helpers and imports
    the tests use; `entry_point` names the program's function the tests call (default: every name the tests load
    that they, the prefix and the builtins do not define). `visible` (assert style too: the examples the task's
    prompt shows, `visible_tests`) runs after the tests, through the same proxy and clock, only when every test
    passed: one that fails, raises or outlives the sandbox sets `audit_failed` (the verdict stays the tests')."""
    t0 = time.monotonic()
    try:
        body = ast.parse(tests).body
    except SyntaxError as e:
        return CodeResult(0, 0, "refused", f"the tests do not parse: {e}")
    try:
        shown = [compile(ast.Module([s], []), "visible.py", "exec") for s in ast.parse(visible or "").body]
    except SyntaxError as e:
        return CodeResult(0, 0, "refused", f"the visible examples do not parse: {e}")
    trusted = _prefix_code(prefix)
    steps = [(_is_test(s), compile(ast.Module([s], []), "tests.py", "exec")) for s in body]
    total = sum(is_test for is_test, _ in steps)
    try:
        python = interpreter()
    except SandboxUnavailable as e:
        return CodeResult(0, 0, "refused", str(e))
    namespace: dict[str, Any] = {"__name__": "tests"}
    names = [entry_point] if entry_point else []
    try:
        exec(compile(trusted, "prefix.py", "exec"), namespace)
        for name in [] if entry_point else _free_names(ast.Module(body, []), trusted):
            if name in sys.stdlib_module_names:  # tests that lean on the program's `import math`
                namespace[name] = importlib.import_module(name)
            else:
                names.append(name)
    except Exception as e:
        return CodeResult(0, total, "crashed", f"the task's prefix raised {type(e).__name__}: {e}")
    passed, failed, status, message, audit_failed = 0, [], "", "", False
    with _sandbox(python, {"solution.py": program}, "assert", Limits(timeout_s, memory_mb)) as box:
        try:
            box.expect("ready")
            namespace.update({name: _Proxy(box, name) for name in names})
            for i, (is_test, code) in enumerate(steps, 1):
                if time.monotonic() >= box.deadline:
                    box.end("timeout", f"ran past {timeout_s:g} s")
                try:
                    exec(code, namespace)
                except Exception as e:
                    if box.ended:
                        raise box.ended from None
                    if not is_test:
                        status, message = "crashed", f"set-up statement {i} raised {type(e).__name__}: {e}"
                        break
                    failed.append(f"{i}: {type(e).__name__}")
                    continue
                if box.ended:  # a test that caught the sandbox's end did not pass
                    raise box.ended
                passed += is_test
        except _Ended as end:
            status, message = end.status, end.message
        if shown and not status and total and passed == total:
            audit_failed = not _all_pass(box, shown, namespace)
        output = box.close()
    if not status:
        status = "ok" if total and passed == total else "failed"
        message = "; ".join(failed) if total else "the tests hold no test"
    return CodeResult(passed, total, status, message[:300], output, time.monotonic() - t0, audit_failed)


def _all_pass(box: _Sandbox, statements: list[Any], namespace: dict[str, Any]) -> bool:
    """Whether every one of `statements` (the visible examples) runs in the tests' `namespace` without raising,
    before the sandbox's deadline and without its end."""
    try:
        for code in statements:
            if time.monotonic() >= box.deadline:
                return False
            exec(code, namespace)
            if box.ended:
                return False
    except (Exception, _Ended):
        return False
    return True


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def execute_stdio(program: str, cases: list[tuple[str, str]], timeout_s: float = 5.0,
                  memory_mb: int = 512) -> CodeResult:
    """Run `program` once per (stdin, expected stdout) case, in one fresh sandbox that sees the stdins only; compare
    here. -> CodeResult."""
    t0 = time.monotonic()
    if not cases:
        return CodeResult(0, 0, "refused", "no cases")
    try:
        python = interpreter()
    except SandboxUnavailable as e:
        return CodeResult(0, 0, "refused", str(e))
    outcome: list[bool] = []
    status = message = ""
    stdins = json.dumps([stdin for stdin, _ in cases])
    with _sandbox(python, {"solution.py": program, "stdins.json": stdins}, "stdio", Limits(timeout_s, memory_mb)) as box:
        try:
            for i, (_, expected) in enumerate(cases):
                reply = box.expect("case")
                try:
                    stdout = wire.untag(reply.get("stdout"))
                except wire.Malformed:
                    stdout = None
                if reply["case"] != i or type(stdout) is not bytes or type(reply.get("returncode")) is not int:
                    box.end("crashed", f"the sandbox answered something malformed for case {i + 1}")
                outcome.append(reply["returncode"] == 0 and reply.get("truncated") is False
                               and _lines(stdout.decode(errors="replace")) == _lines(expected))
        except _Ended as end:
            status, message = end.status, end.message
        output = box.close()
    passed = sum(outcome)
    if not status:
        status = "ok" if passed == len(cases) else "failed"
        message = "" if status == "ok" else "cases " + " ".join("1" if o else "0" for o in outcome)
    return CodeResult(passed, len(cases), status, message, output, time.monotonic() - t0)


# ------------------------------------------------------------------------------------------------
# The reward function (rlcli.rewards.functions registers it as `code`).

FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
EXTRACT = ("last_block", "whole")
IMPORT = re.compile(r"^(import|from)\s+\w")
COUNTS = tuple(f"code_{s}" for s in (*STATUSES[:-1], "no_program"))
"""What the step's metrics count (reward/code_ok, ...): every execution's status but refused (a refusal stops the
run), and responses without a program. The same names on every rank, every step (they are all-reduced)."""
AUDIT = "audit_flagged"
"""The one extra a reward function (or a model part, rlcli.rewards.scorer) returns that is not a count: 1.0 for a
response that scored the part's maximum while an independent check fails (here: a visible example of the task;
the judge: a contradictory verdict), else 0. The step logs reward/audit_flagged, the fraction of its trajectories
that any part flagged (docs/rewards.md, "The reward audit")."""


def extract_program(response: str, how: str = "last_block") -> str | None:
    """The program in a response: its last fenced block (```python ... ```, or ``` ... ```), or the whole reply
    (`how="whole"`). None when `last_block` finds no closed block."""
    if how == "whole":
        return response
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else None


def visible_tests(truth: dict[str, Any]) -> str | None:
    """The examples an assert-style task's prompt shows, as tests: its ground truth's `visible` (code_fns writes its
    question's example there, HumanEval rows their docstring's right ones), else its prefix's doctest examples
    (doctest_checks); None where there are none (`visible` empty, or no `>>>` example), and then no audit."""
    if "visible" in truth:
        return truth["visible"] or None
    if truth.get("prefix") and truth.get("entry_point"):
        return doctest_checks(truth["prefix"], truth["entry_point"])
    return None


def run_ground_truth(program: str, ground_truth: str, timeout_s: float, memory_mb: int, url: str | None) -> CodeResult:
    """Execute `program` against a code task's ground truth (the JSON of the module docstring); assert style on this
    machine with the task's visible examples after its tests (visible_tests; `audit_failed`)."""
    try:
        truth = json.loads(ground_truth)
    except json.JSONDecodeError as e:
        raise ValueError(f"a code task's ground truth is JSON ({{\"assert\": ...}} or {{\"stdio\": ...}}): {e}") from None
    if "assert" in truth:
        entry = truth.get("entry_point")
        prefix = truth.get("prefix") or ""
        if prefix and entry and not re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", program, re.M):
            program = prefix + program  # a completion of the prompt's signature, HumanEval style
        elif prefix:  # a whole function: the prompt's imports still apply (HumanEval's `from typing import List`)
            program = "".join(line + "\n" for line in prefix.splitlines() if IMPORT.match(line)) + program
        if url:
            return remote_execute(url, program, truth["assert"], "assert", timeout_s)
        return execute(program, truth["assert"], timeout_s, memory_mb, prefix=prefix, entry_point=entry,
                       visible=visible_tests(truth))
    if "stdio" in truth:
        cases = [(str(i), str(o)) for i, o in truth["stdio"]]
        if url:
            return remote_execute(url, program, cases, "stdio", timeout_s)
        return execute_stdio(program, cases, timeout_s, memory_mb)
    raise ValueError(f"a code task's ground truth has neither 'assert' nor 'stdio' (keys: {sorted(truth)})")


def code_reward(response: str, ground_truth: str, *, code_extract: str = "last_block", code_partial_credit: bool = False,
                code_timeout_s: float = 5.0, code_memory_mb: int = 512, code_url: str | None = None,
                **options: Any) -> tuple[float, dict[str, float]]:
    """(the fraction of tests passed, or 1/0 for all of them (code_partial_credit=false); COUNTS, 1 for how the
    execution ended, and AUDIT, 1 for an ok execution that fails a visible example of its task). A response without
    a program scores 0, counted as code_no_program."""
    program = extract_program(response, code_extract)
    if program is None or not program.strip():
        return 0.0, {**{name: float(name == "code_no_program") for name in COUNTS}, AUDIT: 0.0}
    r = run_ground_truth(program, ground_truth, code_timeout_s, code_memory_mb, code_url)
    if r.status == "refused":
        raise SandboxUnavailable(r.message)
    value = r.passed / r.total if code_partial_credit and r.total else float(r.status == "ok")
    return value, {**{name: float(name == f"code_{r.status}") for name in COUNTS}, AUDIT: float(r.audit_failed)}


def remote_execute(url: str, program: str, tests: Any, style: str, timeout_s: float) -> CodeResult:
    """An external sandbox service (reward.code.url): POST {"program", "tests" | "cases", "timeout_s"} as JSON,
    answered with {"passed", "total", "status", "message"} (docs/code_rewards.md#an-external-sandbox)."""
    import urllib.request

    body = {"program": program, "timeout_s": timeout_s, **({"tests": tests} if style == "assert" else {"cases": tests})}
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s + 30) as answer:
        got = json.loads(answer.read(1 << 20))
    if got.get("status") not in STATUSES:
        raise ValueError(f"reward.code.url answered status {got.get('status')!r}, not one of {', '.join(STATUSES)}")
    return CodeResult(int(got["passed"]), int(got["total"]), got["status"], str(got.get("message", "")))
