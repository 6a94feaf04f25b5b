"""`python kill_during_save.py STEP <rlcli args>`: run rlcli, and SIGKILL this process in the middle of
writing step STEP's checkpoint, right after the actor's DeepSpeed files are on disk."""

import os
import signal
import sys

from rlcli import engine
from rlcli.commands.cli import main

STEP = int(sys.argv[1])
save = engine.Engine.save


def save_then_die(self, directory, tag):
    save(self, directory, tag)
    if os.path.basename(directory) == f".step_{STEP}.tmp":
        os.kill(os.getpid(), signal.SIGKILL)


engine.Engine.save = save_then_die
main(sys.argv[2:])
