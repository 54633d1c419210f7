"""What a worker reads about its own process from /proc (the workers run under mpiexec, one per rank)."""
from __future__ import annotations


def peak_rss() -> int:
    """This process's peak resident set size in bytes (VmHWM: unlike ru_maxrss, a forked child's starts at 0)."""
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
