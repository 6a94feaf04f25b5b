"""Code rewards (reward=code): a response's program run against its task's tests in a sandbox.

    execute(program, tests, timeout_s=5.0) -> CodeResult             # assert-style tests (HumanEval, MBPP)
    execute_stdio(program, cases, timeout_s=5.0) -> CodeResult       # stdin/stdout cases (competitive programming)

The ground truth of a code task (its data row's answer column) is JSON, `{"assert": TESTS, "prefix": CODE,
"entry_point": NAME}` or `{"stdio": [[STDIN, STDOUT], ...]}` (rlcli.data.code_tasks builds both). Assert style: each
top-level `assert` statement and each top-level bare call (`check(candidate)`) of TESTS is one test, run in order
in the program's namespace; other top-level statements are set-up. Stdin/stdout style: each case runs the program
afresh with STDIN and compares its output to STDOUT, line by line with trailing spaces stripped.

The sandbox (Linux), for every execution, docs/code_rewards.md:
- namespaces (`unshare`): a user namespace, a network namespace (no interface but a loopback that is down: no
  network at all), a PID namespace (the program is PID 1's child or PID 1 itself; when PID 1 exits the kernel kills
  every process left in it, so a daemonised grandchild dies with it), a mount namespace in which every mount is
  remounted read-only except the execution's own fresh working directory;
- run as an unprivileged user (nobody, 65534) when the trainer is root: RLIMIT_NPROC binds only for a non-root
  user; limits on CPU seconds, address space, file size, processes and open files; no core files;
- a minimal environment: none of the trainer's variables (tokens, keys); `python -I` (no PYTHON* variables, no user
  site-packages, no working folder on sys.path);
- the whole process group killed at the wall-clock limit; output read with a cap (the program is killed when it
  passes it, status `output_limit`);
- the working directory removed afterwards.
Results come back on their own pipe, each line tagged with a random nonce, after all tests have run: a program
that prints a fake result, exits early (sys.exit, os._exit) or redefines the tests' helpers scores nothing it did
not pass. What it does not protect against (a kernel exploit, a program that reads the harness's own memory for the
nonce) is written in docs/code_rewards.md, with `reward.code.url` for an external sandbox service.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

STATUSES = ("ok", "failed", "timeout", "crashed", "memory", "output_limit", "refused")
"""Outcomes of one execution: all tests passed | some failed | the wall-clock or CPU limit | the program raised,
exited or died before its tests ran to the end | its memory limit | it printed past the cap | not run (no sandbox,
a malformed request)."""

NOBODY = 65534
OUTPUT_CAP = 64 * 1024  # bytes of the program's stdout + stderr kept; past it the program is killed
FILE_SIZE_MB = 16
OPEN_FILES = 64
PROCESSES = 32  # per execution (RLIMIT_NPROC inside its own user namespace)


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


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    processes: int = PROCESSES
    file_size_mb: int = FILE_SIZE_MB
    open_files: int = OPEN_FILES


# ------------------------------------------------------------------------------------------------
# Inside the sandbox. LAUNCHER runs as root of the new user namespace: it remounts every mount read-only but the
# working directory, forks (it stays PID 1), and the child sets the limits and runs HARNESS, which reads the tests
# before the program can touch anything.

LAUNCHER = r"""
import ctypes, os, resource, sys
work, limits, python = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
         "relatime": 1 << 21, "strictatime": 1 << 24}
def mount(src, target, flags):
    if libc.mount(src, target.encode(), None, flags, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")
mount(work.encode(), work, MS_BIND | MS_REC)
for line in open("/proc/self/mountinfo").read().splitlines():
    fields = line.split()
    target = fields[4].encode().decode("unicode_escape")
    if target == work or target == "/proc" or target.startswith("/proc/"):
        continue
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for opt in fields[5].split(","):
        flags |= FLAGS.get(opt, 0)  # a mount's locked flags must be kept in a user namespace
    mount(None, target, flags)
cpu, mem, nproc, fsize, nofile = limits
pid = os.fork()  # this process stays PID 1 of the namespace: when it exits, the kernel kills all that is left
if pid == 0:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit: reported as a timeout
    for what, n in ((resource.RLIMIT_AS, mem << 20), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_FSIZE, fsize << 20),
                    (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (n, n))
    os.chdir(work)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work})
    sys.argv = ["harness.py", *sys.argv[4:]]
    exec(compile(open("harness.py").read(), "harness.py", "exec"), {"__name__": "__main__"})  # no second start-up
    sys.stdout.flush()
    os._exit(0)
status = os.waitpid(pid, 0)[1]
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""

HARNESS = r"""
import ast, builtins, os, subprocess, sys
nonce, style, timeout_s = sys.stdin.readline().strip(), sys.argv[1], float(sys.argv[2])
devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(devnull, 0)
write, results = os.write, int(sys.argv[3])  # bound now: the program may rebind names, not these
def report(passed, total, status, message=""):
    write(results, f"{nonce} {passed} {total} {status} {message[:300]!r}\n".encode())
if style == "stdio":
    cases = __import__("json").load(open("cases.json"))
    outcome = []
    for stdin, expected in cases:
        try:
            run = subprocess.run([sys.executable, "-I", "-X", "utf8", "solution.py"], input=stdin.encode(),
                                 capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            report(sum(outcome), len(cases), "timeout", "a case ran past the time limit")
            raise SystemExit(0)
        got = [line.rstrip() for line in run.stdout.decode(errors="replace").rstrip().splitlines()]
        want = [line.rstrip() for line in expected.rstrip().splitlines()]
        outcome.append(run.returncode == 0 and got == want)
        sys.stdout.buffer.write(run.stdout[:4096]); sys.stderr.buffer.write(run.stderr[:4096])
    passed = sum(outcome)
    report(passed, len(cases), "ok" if passed == len(cases) else "failed", "" if passed == len(cases) else
           "cases " + " ".join("1" if o else "0" for o in outcome))
    raise SystemExit(0)
tests = ast.parse(open("tests.py").read())
steps = [(isinstance(s, ast.Assert) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)),
          compile(ast.Module([s], []), "tests.py", "exec")) for s in tests.body]
total = sum(is_test for is_test, _ in steps)
pristine = dict(builtins.__dict__)
namespace = {"__name__": "solution", "__builtins__": builtins}
def kind(e):
    return "memory" if isinstance(e, MemoryError) else "crashed"
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
except BaseException as e:
    report(0, total, kind(e), f"the program raised {type(e).__name__}: {e}")
    raise SystemExit(0)
passed, failed = 0, []
for i, (is_test, code) in enumerate(steps):
    builtins.__dict__.clear(); builtins.__dict__.update(pristine)  # what the program patched does not reach a test
    try:
        exec(code, namespace)
        passed += is_test
    except BaseException as e:
        if isinstance(e, MemoryError):
            report(passed, total, "memory", f"test {i + 1}: MemoryError")
            raise SystemExit(0)
        if not is_test:
            report(passed, total, "crashed", f"set-up statement {i + 1} raised {type(e).__name__}: {e}")
            raise SystemExit(0)
        failed.append(f"{i + 1}: {type(e).__name__}")
report(passed, total, "ok" if passed == total else "failed", "; ".join(failed))
"""


# ------------------------------------------------------------------------------------------------
# The trainer's side.

class SandboxUnavailable(RuntimeError):
    """This machine cannot run the sandbox (no unprivileged user namespaces, no unshare): the message says how."""


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


def _run(files: dict[str, str], style: str, limits: Limits) -> CodeResult:
    """Run HARNESS over `files` (solution.py, and tests.py or cases.json) in a fresh sandbox."""
    t0 = time.monotonic()
    try:
        python = interpreter()
    except SandboxUnavailable as e:
        return CodeResult(0, 0, "refused", str(e))
    work = tempfile.mkdtemp(prefix="rlcli-code-")
    try:
        for name, text in {**files, "harness.py": HARNESS}.items():
            with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                f.write(text)
        if _drop_to_nobody():
            for p in [work, *(os.path.join(work, n) for n in os.listdir(work))]:
                os.chown(p, NOBODY, NOBODY)
        return _supervise(python, work, style, limits, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _supervise(python: str, work: str, style: str, limits: Limits, t0: float) -> CodeResult:
    nonce = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    cpu = max(1, int(limits.timeout_s + 1))
    caps = f"{cpu},{limits.memory_mb},{limits.processes},{limits.file_size_mb},{limits.open_files}"
    cmd = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--mount-proc",
           "--kill-child", python, "-I", "-X", "utf8", "-c", LAUNCHER, work, caps, python, style, str(limits.timeout_s), str(write_end)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            pass_fds=(write_end,), start_new_session=True, env={"PATH": "/usr/bin:/bin"}, **_user())
    os.close(write_end)
    output, lines = bytearray(), bytearray()
    over = threading.Event()

    def drain(fd: int, into: bytearray, cap: int) -> None:
        while chunk := os.read(fd, 65536):
            room = cap - len(into)
            into += chunk[:max(room, 0)]
            if len(chunk) > room:
                over.set()
                _kill(proc)
                return

    readers = [threading.Thread(target=drain, args=(proc.stdout.fileno(), output, OUTPUT_CAP), daemon=True),
               threading.Thread(target=drain, args=(read_end, lines, 64 * 1024), daemon=True)]
    for r in readers:
        r.start()
    try:
        proc.stdin.write(nonce.encode() + b"\n")
        proc.stdin.close()
    except BrokenPipeError:
        pass
    timed_out = False
    try:
        proc.wait(timeout=limits.timeout_s + 2.0)  # the harness's start-up (~0.1 s) on top of the program's limit
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill(proc)
    proc.wait()
    for r in readers:
        r.join(timeout=5)
    os.close(read_end)
    proc.stdout.close()
    text = output.decode(errors="replace")
    seconds = time.monotonic() - t0
    if over.is_set():
        return CodeResult(0, 0, "output_limit", f"output past {OUTPUT_CAP} bytes", text, seconds)
    report = [line.split(" ", 4) for line in lines.decode(errors="replace").splitlines() if line.startswith(nonce + " ")]
    if timed_out and not report:
        return CodeResult(0, 0, "timeout", f"ran past {limits.timeout_s:g} s", text, seconds)
    if not report:
        code = proc.returncode or 0
        sig = code - 128 if code > 128 else -code if code < 0 else 0  # the launcher reports a signal as 128 + it
        if sig == signal.SIGXCPU:
            return CodeResult(0, 0, "timeout", f"ran past its {cpu} CPU seconds", text, seconds)
        why = f"was killed by {signal.Signals(sig).name}" if sig > 0 else f"exited with status {code}"
        return CodeResult(0, 0, "crashed", f"no result: the program {why} before its tests ran to the end", text,
                          seconds)
    _, passed, total, status, message = report[-1]
    return CodeResult(int(passed), int(total), status, _unquote(message), text, seconds)


def _unquote(text: str) -> str:
    import ast

    try:
        return str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return text


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group (unshare and PID 1 of its namespace; the rest die with PID 1)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def execute(program: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512) -> CodeResult:
    """Run `program`, then the assert-style `tests` in its namespace, in a fresh sandbox. -> CodeResult."""
    import ast

    try:
        ast.parse(tests)
    except SyntaxError as e:
        return CodeResult(0, 0, "refused", f"the tests do not parse: {e}")
    return _run({"solution.py": program, "tests.py": tests}, "assert", Limits(timeout_s, memory_mb))


def execute_stdio(program: str, cases: list[tuple[str, str]], timeout_s: float = 5.0,
                  memory_mb: int = 512) -> CodeResult:
    """Run `program` once per (stdin, expected stdout) case, in one fresh sandbox. -> CodeResult."""
    if not cases:
        return CodeResult(0, 0, "refused", "no cases")
    return _run({"solution.py": program, "cases.json": json.dumps([list(c) for c in cases])}, "stdio",
                Limits(timeout_s, memory_mb))


# ------------------------------------------------------------------------------------------------
# The reward function (rlcli.rewards.functions registers it as `code`).

FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
EXTRACT = ("last_block", "whole")
IMPORT = re.compile(r"^(import|from)\s+\w")
COUNTS = tuple(f"code_{s}" for s in (*STATUSES[:-1], "no_program"))
"""What the step's metrics count (reward/code_ok, ...): every execution's status but refused (a refusal stops the
run), and responses without a program. The same names on every rank, every step (they are all-reduced)."""


def extract_program(response: str, how: str = "last_block") -> str | None:
    """The program in a response: its last fenced block (```python ... ```, or ``` ... ```), or the whole reply
    (`how="whole"`). None when `last_block` finds no closed block."""
    if how == "whole":
        return response
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else None


def run_ground_truth(program: str, ground_truth: str, timeout_s: float, memory_mb: int, url: str | None) -> CodeResult:
    """Execute `program` against a code task's ground truth (the JSON of the module docstring)."""
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
        return execute(program, truth["assert"], timeout_s, memory_mb)
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
    execution ended). A response without a program scores 0, counted as code_no_program."""
    program = extract_program(response, code_extract)
    if program is None or not program.strip():
        return 0.0, {name: float(name == "code_no_program") for name in COUNTS}
    r = run_ground_truth(program, ground_truth, code_timeout_s, code_memory_mb, code_url)
    if r.status == "refused":
        raise SandboxUnavailable(r.message)
    value = r.passed / r.total if code_partial_credit and r.total else float(r.status == "ok")
    return value, {name: float(name == f"code_{r.status}") for name in COUNTS}


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
