"""A rank that dies without a word is named by its rank: a small watcher process per rank.

A rank killed by a signal (SIGKILL, the out-of-memory killer) or crashed in native code runs no Python, so
neither the exception hook (guard.py) nor the watchdog can speak for it, and MPICH's launcher names a process
id and host (often another rank's). So each rank starts one watcher, a child that blocks reading a pipe whose
only write end the rank holds. The kernel closes that end however the rank ends; a rank that ends cleanly (at
exit, or in zerompi's own abort, which has reported already) first writes ``QUIET``. A watcher that reads the
end of the pipe without it prints one line naming the rank and exits.

Why only the rank that died first speaks: the watcher stays in its rank's process group, and a launcher that
tears the job down (MPICH's hydra, Slurm) kills whole groups, the other ranks' watchers with their ranks,
before those watchers can run. The watcher of a rank that died first leaves the group at once (``setsid``),
so the same teardown does not cut its line short.

The watcher runs this file by path (``python -I``): standard library only, no torch, no mpi4py, started in
tens of milliseconds. Children a rank forks (DataLoader workers) close their copy of the write end, so a dead
rank's pipe ends when the rank does.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time

QUIET = b"q"  # the rank ends cleanly (at exit) or through zerompi's abort (which reported it)

_write_end: int | None = None  # this process's end of the pipe, once started
_watcher: subprocess.Popen | None = None


def start(rank: int, size: int, host: str) -> None:
    """Start this process's watcher (once; a later call does nothing)."""
    global _write_end, _watcher
    if _write_end is not None:
        return
    read_end, write_end = os.pipe()
    try:
        _watcher = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(read_end), str(rank), str(size), host,
             str(os.getpid())],
            pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    except OSError:
        os.close(write_end)  # no watcher: a killed rank is named by the launcher alone, as before
        return
    finally:
        os.close(read_end)
    _write_end = write_end
    atexit.register(quiet)
    os.register_at_fork(after_in_child=_forget)


def quiet() -> None:
    """This rank's end needs no line from the watcher: a clean exit, or an abort that reported already."""
    global _write_end
    if _write_end is None:
        return
    try:
        os.write(_write_end, QUIET)
        os.close(_write_end)
    except OSError:
        pass
    _write_end = None


def _forget() -> None:
    """In a forked child: close the inherited write end, which is the rank's alone."""
    global _write_end, _watcher
    if _write_end is not None:
        try:
            os.close(_write_end)
        except OSError:
            pass
    _write_end, _watcher = None, None


def line(rank: int, size: int, host: str, pid: int, when: float) -> str:
    """What the watcher prints for a rank that ended without a clean exit."""
    stamp = time.strftime("%H:%M:%S", time.gmtime(when))
    return (f"zerompi: rank {rank} of {size} (pid {pid} on {host}) ended at {stamp} UTC without a clean exit: "
            "killed by a signal (SIGKILL, the out-of-memory killer) or crashed in native code\n")


def watch(read_end: int) -> bool:
    """Block until the rank's pipe ends; whether it ended without ``QUIET`` (the rank died)."""
    said = b""
    while chunk := os.read(read_end, 64):
        said += chunk
    return QUIET not in said


def _main(argv: list[str]) -> int:
    read_end, rank, size, host, pid = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], int(argv[4])
    if not watch(read_end):
        return 0
    try:
        os.setsid()  # out of the rank's process group: the launcher's teardown of the job must not cut us short
    except OSError:
        pass
    try:
        os.write(2, line(rank, size, host, pid, time.time()).encode())
    except OSError:
        pass  # the launcher is gone: nobody to tell
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
