"""PID 1 of an execution's namespaces (rlcli/rewards/code.py starts it: `unshare ... python -I launcher.py WORK CAPS
HARNESS_ARGS...`). As root of the new user namespace it remounts every mount read-only but the working directory,
then forks and stays PID 1: when it exits, the kernel kills every process left in the namespace. The child sets the
limits, leaves a minimal environment and runs harness.py in the same interpreter (no second start-up).

CAPS is "CPU_SECONDS,MEMORY_MB,PROCESSES,FILE_SIZE_MB,OPEN_FILES". Exit status: the child's, or 128 + the signal
that killed it (SIGXCPU at the CPU limit). Standard library only; the trainer's rlcli is not importable here.
"""

import contextlib
import ctypes
import os
import resource
import runpy
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
LOCKED = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
          "relatime": 1 << 21, "strictatime": 1 << 24}
"""Mount flags that must be kept on a remount inside a user namespace (the kernel locks them)."""

libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, flags):
    if libc.mount(source, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def read_only_but(work):
    """Every mount read-only except `work` (bind-mounted on itself so that it is a mount of its own) and /proc."""
    mount(work.encode(), work, MS_BIND | MS_REC)
    with open("/proc/self/mountinfo") as f:
        mounts = f.read().splitlines()
    for line in mounts:
        fields = line.split()
        target = fields[4].encode().decode("unicode_escape")
        if target == work or target == "/proc" or target.startswith("/proc/"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= LOCKED.get(option, 0)
        mount(None, target, flags)


def limit(cpu, memory_mb, processes, file_size_mb, open_files):
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit: reported as a timeout
    for what, n in ((resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_NPROC, processes),
                    (resource.RLIMIT_FSIZE, file_size_mb << 20), (resource.RLIMIT_NOFILE, open_files),
                    (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (n, n))


def main():
    work, caps = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    read_only_but(work)
    pid = os.fork()
    if pid == 0:
        limit(*caps)
        os.chdir(work)
        os.environ.clear()
        os.environ.update({"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work})
        sys.argv = [os.path.join(work, "harness.py"), *sys.argv[3:]]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        finally:
            for stream in (sys.stdout, sys.stderr):  # the program may have closed or replaced them
                with contextlib.suppress(BaseException):
                    stream.flush()
            os._exit(0)  # no interpreter shutdown: nothing the program registered (atexit, threads) runs or waits
    status = os.waitpid(pid, 0)[1]
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
