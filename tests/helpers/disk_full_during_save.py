"""`python disk_full_during_save.py STEP <rlcli args>`: run rlcli with a disk that fills up while step STEP's
checkpoint is written: saving this rank's rank_<r>.pt raises OSError(ENOSPC), after the actor's DeepSpeed files
are on disk, as a full file system would."""

import errno
import os
import sys

import torch

from rlcli.commands.cli import main

STEP = int(sys.argv[1])
save = torch.save


def save_until_full(obj, f, *args, **kwargs):
    if isinstance(f, str) and os.path.basename(os.path.dirname(f)) == f".step_{STEP}.tmp" \
            and os.path.basename(f).startswith("rank_"):
        with open(f, "wb") as partial:  # what a full disk leaves: the first bytes of the file
            partial.write(b"PK\x03\x04")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f)
    return save(obj, f, *args, **kwargs)


torch.save = save_until_full
main(sys.argv[2:])
