"""A pool of worker processes for trusted functions of untrusted input (reward verification, tool calls, agents):
rlcli.rewards, rlcli.envs and rlcli.rollout all run theirs here.

It isolates nothing: a worker is an ordinary process of the trainer's user, with its files, network and
environment. What the pool adds is a clock, a memory cap and a restart per item. Code the policy wrote
runs only in the code sandbox (rlcli/rewards/sandbox/, started per execution by rlcli/rewards/code.py from
inside a worker). Hence its name, WorkerPool: workers, not a sandbox.

Why processes:
- math-verify's own timeouts use ``signal.alarm``, which only works on a main thread, and model output
  is untrusted: ``\\boxed{9^{9^{9^{9}}}}`` makes sympy compute a huge integer inside one C call that no
  Python-level timeout interrupts. Only killing the process stops it.
- Each worker has its own pipe, so a stuck worker is killed and replaced alone while the others keep
  serving. ``concurrent.futures.ProcessPoolExecutor`` cannot cancel a running task.

Why fresh interpreters (``subprocess.Popen([sys.executable, "-c", ...])``, spawn semantics) and not
``fork``: the trainer holds torch/OpenMP threads and DeepSpeed state, and a forked child can deadlock
on a lock another thread held at fork time. Not ``multiprocessing``'s spawn/forkserver either: both
re-import the parent's ``__main__`` (the CLI, hence torch and DeepSpeed) in the worker, which costs
seconds and hundreds of MB per worker under a memory cap meant for the verifier. A worker here imports
only ``rlcli.rewards`` (no torch) and the task's own modules; it gets the parent's ``sys.path``.

Timeouts are two-level, both per item (one response), measured from when it is handed to a worker:
- soft, ``timeout_s``: the worker interrupts itself with SIGALRM; the item is reported as a timeout
  and the worker keeps serving (no restart cost). This catches slow pure-Python work.
- hard, ``timeout_s + kill_grace_s``: if the worker has not answered (stuck in C code, or the
  exception was swallowed), the pool SIGKILLs its process group and starts a replacement.

Each worker caps its address space (RLIMIT_AS = ``memory_mb``) before importing anything, disables
core dumps, ignores SIGINT (the parent owns shutdown), and dies with its parent (PR_SET_PDEATHSIG).
A worker that dies (segfault, external kill, the kernel's OOM killer) is replaced. The item it was
running is retried once, since the death may not be its fault; if it dies again, it is an error. So a
poisonous input costs at most two restarts. Timed-out items are never retried.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any, Literal, NamedTuple

from rlcli.core.registry import import_dotted

_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[2]); "
    "from rlcli.core.workers import _worker_main; _worker_main(int(sys.argv[1]))"
)


_MAX_CHUNK = 8  # items per message to a worker
_MAX_STARTUP_DEATHS = 3  # (deterministic set-up failures raise at once, reported by the worker)


class TaskResult(NamedTuple):
    """Outcome of one item: status "ok" (value set), "timeout" or "error" (message set)."""

    status: Literal["ok", "timeout", "error"]
    value: Any = None
    message: str | None = None


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    pidfd: int | None  # readable when the process exits (Linux >= 5.3), else None
    start_deadline: float
    ready: bool = False
    tasks: deque[int] = field(default_factory=deque)  # indices of the chunk in flight, in order
    deadline: float = float("inf")  # hard deadline of the item the worker is on (tasks[0])
    waitables: list[Any] = field(default_factory=list)


class WorkerPool:
    """Long-lived worker processes that run ``task(item)`` with per-item timeouts and a memory cap (a worker pool:
    no isolation, see the module docstring).

    ``task`` and ``setup`` are dotted paths (``"pkg.module.fn"``) imported in the worker;
    ``setup(*setup_args)`` runs once per worker, before any item. Workers start in the constructor
    without blocking; :meth:`map` waits for them. Not thread-safe per call: calls are serialised.
    """

    def __init__(
        self,
        task: str,
        *,
        setup: str | None = None,
        setup_args: tuple[Any, ...] = (),
        num_workers: int = 2,
        timeout_s: float = 5.0,
        memory_mb: int = 2048,
        kill_grace_s: float = 0.5,
        startup_timeout_s: float = 120.0,
    ):
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self._init = {
            "task": task,
            "setup": setup,
            "setup_args": setup_args,
            "memory_mb": memory_mb,
            "timeout_s": timeout_s,
            "parent_pid": os.getpid(),
        }
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0  # workers replaced after a hard timeout or a death, since start
        self._startup_deaths = 0  # consecutive workers that died before becoming ready
        self._died_on: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []  # mutated in place: the finalizer holds the same list
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        for _ in range(num_workers):
            self._workers.append(self._spawn())

    # -- public -------------------------------------------------------------------------------

    def map(self, items: Sequence[Any]) -> list[TaskResult]:
        """Run the task on every item, spread over the workers; results in item order."""
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool is closed")
            results: list[TaskResult | None] = [None] * len(items)
            todo = deque(range(len(items)))
            self._died_on = set()  # items whose worker died once already (this call)
            while todo or any(w.tasks for w in self._workers):
                self._dispatch(items, todo, results)
                self._wait_and_collect(results, todo)
            return results  # type: ignore[return-value]

    def wait_ready(self) -> None:
        """Block until every worker has started (or raise if one cannot)."""
        with self._lock:
            while not all(w.ready for w in self._workers):
                self._wait_and_collect([], deque())

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop all workers (idempotent; also runs at interpreter exit)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = Pipe(duplex=True)
        fd = child_conn.fileno()
        # The worker is single-threaded by design; keep numeric libraries a user function may
        # import from spawning thread pools (and reserving address space under RLIMIT_AS).
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        sys_path = json.dumps([p for p in sys.path if isinstance(p, str)])
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(fd), sys_path],
            pass_fds=(fd,),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: a kill reaches anything the task started
        )
        child_conn.close()
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pidfd = None
        init = dict(self._init, die_with_parent=threading.current_thread() is threading.main_thread())
        with contextlib.suppress(OSError):  # if it died at once, the next wait sees (and reports) it
            parent_conn.send(init)
        w = _Worker(proc, parent_conn, pidfd, time.monotonic() + self.startup_timeout_s)
        w.waitables = [parent_conn] + ([pidfd] if pidfd is not None else [])
        return w

    def _replace(self, w: _Worker) -> None:
        _kill(w)
        self._workers[self._workers.index(w)] = self._spawn()
        self.restarts += 1

    def _dispatch(self, items: Sequence[Any], todo: deque[int], results: list[Any]) -> None:
        # Chunks spare the worker a round trip to this (busy, CPU-starved) process per item; they
        # stay small so the slow items of a batch still spread over the workers. Only idle workers
        # get one, so a large send never waits behind a stuck item.
        idle = [w for w in self._workers if w.ready and not w.tasks]
        for w in idle:
            if not todo:
                return
            size = max(1, min(_MAX_CHUNK, len(todo) // (2 * len(self._workers))))
            chunk = [todo.popleft() for _ in range(min(size, len(todo)))]
            try:
                w.conn.send([items[i] for i in chunk])
            except OSError:
                todo.extendleft(reversed(chunk))  # the worker died while idle: nothing ran
                self._replace(w)
                continue
            except Exception:  # an item cannot be pickled: find it, send the rest one by one later
                for i in reversed(chunk):
                    try:
                        pickle.dumps(items[i])
                        todo.appendleft(i)
                    except Exception as e:
                        results[i] = TaskResult("error", None, f"cannot send item: {type(e).__name__}")
                continue
            w.tasks.extend(chunk)
            w.deadline = time.monotonic() + self.timeout_s + self.kill_grace_s

    def _wait_and_collect(self, results: list[Any], todo: deque[int]) -> None:
        now = time.monotonic()
        deadlines = [w.deadline if w.ready else w.start_deadline for w in self._workers]
        first = min(deadlines, default=float("inf"))
        timeout = None if first == float("inf") else max(0.0, first - now)
        owner = {obj: w for w in self._workers for obj in w.waitables}
        for obj in wait(list(owner), timeout):
            w = owner[obj]
            # Take every reply already queued. EOF, or an exited process (its pidfd) with nothing
            # left to read, is a death. A worker replaced earlier in this round is skipped.
            while w in self._workers:
                if not w.conn.poll():
                    if obj is not w.conn:
                        self._on_death(w, results, todo)
                    break
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    self._on_death(w, results, todo)
                    break
                self._on_message(w, msg, results)
                if msg[0] == "retire":  # its task left a thread it cannot stop: a fresh worker takes its place
                    todo.extendleft(reversed(w.tasks))
                    w.tasks.clear()
                    self._replace(w)
        now = time.monotonic()
        for w in list(self._workers):
            if w.tasks and now >= w.deadline:
                results[w.tasks.popleft()] = TaskResult(
                    "timeout", None, f"no answer after {self.timeout_s + self.kill_grace_s:.1f} s"
                )
                todo.extendleft(reversed(w.tasks))  # the rest of its chunk never ran
                w.tasks.clear()
                self._replace(w)
            elif not w.ready and now >= w.start_deadline:
                self.close()
                raise RuntimeError(f"a worker process did not start within {self.startup_timeout_s:.0f} s")

    def _on_message(self, w: _Worker, msg: tuple[str, Any], results: list[Any]) -> None:
        kind, payload = msg
        if kind == "ready":
            w.ready = True
            self._startup_deaths = 0
        elif kind == "init_error":
            self.close()
            raise RuntimeError(f"a worker process failed to start: {payload}")
        elif w.tasks:
            i = w.tasks.popleft()
            if kind in ("ok", "retire"):
                results[i] = TaskResult("ok", payload)
            else:
                results[i] = TaskResult(kind, None, payload)  # type: ignore[arg-type]
            # The worker started the next item of its chunk when it sent this reply.
            w.deadline = time.monotonic() + self.timeout_s + self.kill_grace_s if w.tasks else float("inf")

    def _on_death(self, w: _Worker, results: list[Any], todo: deque[int]) -> None:
        _kill(w)
        why = _exit_reason(w.proc.returncode)
        if not w.ready:
            self._startup_deaths += 1
            if self._startup_deaths >= _MAX_STARTUP_DEATHS:
                self.close()
                raise RuntimeError(
                    f"{self._startup_deaths} worker processes in a row died during start-up (last: {why})"
                )
        if w.tasks:
            i = w.tasks.popleft()
            if i in self._died_on:
                results[i] = TaskResult("error", None, f"worker died twice on it ({why})")
            else:
                self._died_on.add(i)
                w.tasks.appendleft(i)
            todo.extendleft(reversed(w.tasks))
            w.tasks.clear()
        self._replace(w)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _kill(w: _Worker) -> None:
    if w.proc.poll() is None:
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            w.proc.kill()
    w.proc.wait()
    w.conn.close()
    if w.pidfd is not None:
        os.close(w.pidfd)
        w.pidfd = None


def _shutdown(workers: list[_Worker], grace_s: float = 1.0) -> None:
    """Ask idle workers to exit, then kill whatever is left (the finalizer; no reference to the pool)."""
    for w in workers:
        if w.proc.poll() is None and not w.tasks:
            with contextlib.suppress(OSError):
                w.conn.send(None)
    end = time.monotonic() + grace_s
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(max(0.0, end - time.monotonic()))
        if not w.conn.closed:
            _kill(w)
    workers.clear()


# ---------------------------------------------------------------------------------------------
# The worker process.


_RETIRE = [False]


def retire_after_reply() -> None:
    """Called by a task in a worker: this worker is replaced once the task's result is back (the task left a thread
    running that nothing can stop, say), and runs nothing more."""
    _RETIRE[0] = True


class _SoftTimeout(BaseException):
    """Raised by SIGALRM inside a task. A BaseException, so `except Exception` in verifier code
    (math-verify has several) does not swallow it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _SoftTimeout()


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a worker stuck in C code would otherwise outlive a crashed trainer. It fires
    # when the *thread* that started the worker exits, so it is armed only for workers started from
    # the main thread (others still exit on EOF when idle, and on their soft timeout when busy).
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _limit_resources(memory_mb: int) -> None:
    import resource

    limit = memory_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _worker_main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    init = conn.recv()
    if init["die_with_parent"]:
        _die_with_parent()
    if os.getppid() != init["parent_pid"]:  # the parent died before PDEATHSIG was armed
        return
    try:
        _limit_resources(init["memory_mb"])
        task = import_dotted(init["task"])
        if init["setup"]:
            import_dotted(init["setup"])(*init["setup_args"])
    except MemoryError:
        conn.send(("init_error", f"out of memory under memory_mb={init['memory_mb']}; raise it"))
        return
    except BaseException as e:
        conn.send(("init_error", f"{type(e).__name__}: {describe_args(e)}"))
        return
    conn.send(("ready", os.getpid()))
    signal.signal(signal.SIGALRM, _on_alarm)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if chunk is None:
            return
        for item in chunk:  # one reply per item: the parent restarts the item's clock on each
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, init["timeout_s"])
                    value = task(item)
                    reply: tuple[str, Any] = ("retire" if _RETIRE[0] else "ok", value)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except _SoftTimeout:
                reply = ("timeout", f"interrupted after {init['timeout_s']} s")
            except Exception as e:
                reply = ("error", f"{type(e).__name__}: {describe_args(e)}")
            try:
                conn.send(reply)
            except (OSError, EOFError):
                return
            except Exception as e:  # an unpicklable task result
                conn.send(("error", f"cannot send result: {type(e).__name__}"))


def describe_args(exc: BaseException) -> str:
    """An exception's message without calling repr on its arguments.

    str() of an exception holding a sympy object can itself take forever (math-verify warns about
    this), so only string arguments are shown.
    """
    return ", ".join(a[:200] for a in exc.args if isinstance(a, str))
