"""The code sandbox's own files (reward=code; rlcli/rewards/code.py, the trainer's side, runs them). docs/code_rewards.md.

    launcher.py   PID 1 of an execution's namespaces: read-only mounts, limits, a minimal environment
    harness.py    the program's side: runs the program and answers the trainer's calls (or runs it per stdin)
    wire.py       what crosses the pipes: values as tagged JSON, one message per line

launcher.py and harness.py are scripts, copied with wire.py into each execution's working directory and run there by
path with `python -I`: standard library only, nothing of rlcli is importable inside the sandbox. The trainer imports
wire.py as rlcli.rewards.sandbox.wire.
"""
