"""The program's side of an execution, run inside the sandbox by launcher.py (rlcli/rewards/code.py is the other side:
the trainer). It holds nothing the verdict depends on: no tests, no expected values, no count. It only answers.

    harness.py assert TIMEOUT_S CALLS_FD ANSWERS_FD   runs solution.py, then answers calls until CALLS_FD closes
    harness.py stdio  TIMEOUT_S CALLS_FD ANSWERS_FD   runs solution.py once per stdin of stdins.json

Messages (wire.py), one JSON object per line on ANSWERS_FD:

    {"ready": true}                                   the program ran; calls may come
    {"answer": VALUE}                                 a call's result (calls come as {"call", "args", "kwargs"})
    {"raised": TYPE_NAME, "message": TEXT}            the call raised
    {"unencodable": TEXT}                             the call returned what wire.py cannot send
    {"case": I, "stdout": BYTES, "truncated": BOOL, "returncode": N}     one stdin's run
    {"fatal": "crashed" | "memory" | "timeout", "message": TEXT}          the end, before the work was done

The program shares this process (assert style) or is its child (stdio), so it can write anything to ANSWERS_FD, or
change what this file sends: it controls its own answers, which it does anyway. The trainer compares them with
values that never enter the sandbox, and counts.
"""

import builtins
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `python -I` puts no script folder on sys.path,
import wire  # noqa: E402  (a sibling file)

del sys.path[0]  # and the program gets none either

CASE_OUTPUT_CAP = 1 << 20  # bytes of one case's stdout sent back; past it the case fails
SHOWN = 4096  # bytes of each case's stdout and stderr copied to this process's own, for CodeResult.output


def describe(e):
    try:
        return f"{type(e).__name__}: {e}"[:300]
    except BaseException:  # a __str__ of the program's that raises
        return type(e).__name__


class Answers:
    def __init__(self, fd):
        self.fd = fd

    def send(self, **fields):
        data = wire.message(**fields)
        while data:
            data = data[os.write(self.fd, data):]


def serve(answers, calls_fd):
    """Assert style: run the program, then call its functions as the trainer asks, one call at a time."""
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        with open("solution.py", encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as e:  # SystemExit too: a program that exits early has not answered
        answers.send(fatal="memory" if isinstance(e, MemoryError) else "crashed",
                     message=f"the program raised {describe(e)}")
        return
    answers.send(ready=True)
    with open(calls_fd, "rb", closefd=False) as calls:
        for line in calls:  # until the trainer closes the pipe
            serve_one(answers, namespace, wire.parse(line))


def serve_one(answers, namespace, call):
    """One call: the program's function on the decoded arguments; its value, its exception's name, or the end."""
    name, args, kwargs = call["call"], wire.untag(call["args"]), wire.untag(call["kwargs"])
    fn = namespace.get(name)
    if not callable(fn):
        answers.send(raised="NameError", message=f"the program defines no function {name!r}")
        return
    try:
        value = fn(*args, **kwargs)
    except MemoryError:
        answers.send(fatal="memory", message=f"{name}: MemoryError")
        raise SystemExit(0) from None
    except BaseException as e:
        answers.send(raised=type(e).__name__, message=describe(e))
        return
    try:
        answer = wire.tag(value)
    except BaseException as e:  # Unencodable, or whatever the value's own methods raise on the way
        answers.send(unencodable=f"{name} returned {describe(e)}")
        return
    answers.send(answer=answer)


def run_cases(answers, timeout_s):
    """Stdin/stdout style: the program afresh per stdin; its stdout and exit status go back, uncompared."""
    with open("stdins.json", encoding="utf-8") as f:
        stdins = json.load(f)
    for i, stdin in enumerate(stdins):
        try:
            run = subprocess.run([sys.executable, "-I", "-X", "utf8", "solution.py"], input=stdin.encode(),
                                 capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            answers.send(fatal="timeout", message=f"case {i + 1} ran past {timeout_s:g} s")
            return
        except OSError as e:  # no process left to start (the program's own children hold RLIMIT_NPROC)
            answers.send(fatal="crashed", message=f"case {i + 1} could not start: {describe(e)}")
            return
        answers.send(case=i, stdout=wire.tag(run.stdout[:CASE_OUTPUT_CAP]),
                     truncated=len(run.stdout) > CASE_OUTPUT_CAP, returncode=run.returncode)
        os.write(1, run.stdout[:SHOWN])
        os.write(2, run.stderr[:SHOWN])


def main():
    style, timeout_s, calls_fd, answers_fd = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the program reads no stdin of the trainer's
    os.close(devnull)
    answers = Answers(answers_fd)
    if style == "stdio":
        run_cases(answers, timeout_s)
    else:
        serve(answers, calls_fd)


if __name__ == "__main__":
    main()
