"""What every results line carries: which code, when, how busy the machine was, which machine and versions.

``stamp()`` is cheap after its first call: the machine and the versions are read once per process; the
commit, the time and the load average are read every time (a long run may span a commit).
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from .paths import ROOT

GiB = 1 << 30


def git(*args: str, cwd: Path = ROOT) -> str:
    """A read-only git command's output ('' where git or the repository is missing)."""
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit(cwd: Path = ROOT, short: bool = False) -> str:
    """HEAD's hash; in a tree exported with ``git archive`` (no .git), the ``.commit`` file beside it."""
    if (cwd / ".commit").exists() and not (cwd / ".git").exists():
        return (cwd / ".commit").read_text().strip()
    return git("rev-parse", *(["--short"] if short else []), "HEAD", cwd=cwd) or "unknown"


def dirty(paths: tuple[str, ...] = (), cwd: Path = ROOT) -> list[str]:
    """The files (among ``paths``, default all) with uncommitted changes, untracked ones included."""
    status = git("status", "--porcelain", "--", *paths, cwd=cwd).splitlines()
    return sorted(line[3:] for line in status)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                platform.processor() or "?")


@lru_cache(maxsize=None)
def machine() -> dict:
    return dict(host=platform.node(), cpus=os.cpu_count(), cpus_usable=len(os.sched_getaffinity(0)),
                cpu=cpu_model(), mem_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
                os=platform.platform())


def machine_line() -> str:
    """``cpu, N cores, X GiB``: the machine in a report's sentence."""
    m = machine()
    return f"{m['cpu']}, {m['cpus']} cores, {m['mem_gib']:.1f} GiB"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# The MPI library is asked in a child process: this one stays free of MPI (it only launches jobs).
_MPI_QUERY = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
              "print(' '.join(MPI.Get_library_version().splitlines()[0].split()))")


@lru_cache(maxsize=None)
def mpi_library() -> str | None:
    try:
        out = subprocess.run([sys.executable, "-c", _MPI_QUERY], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()[:200] or None


@lru_cache(maxsize=None)
def versions(extra: tuple[str, ...] = ()) -> dict:
    """python, torch, mpi4py, the MPI library, zerompi (and the distributions in ``extra``)."""
    found = {d: version(d) for d in ("torch", "mpi4py", "zerompi", *extra)}
    return dict(python=platform.python_version(), **found, mpi=mpi_library())


def stamp() -> dict:
    """The provenance of a line written now."""
    return dict(commit=commit(), dirty=bool(dirty()), utc=utc_now(), loadavg=loadavg(),
                machine=machine(), versions=versions())


def filesystem(directory: Path) -> dict:
    """The mount ``directory`` lies on: its file system type and device."""
    real = os.path.realpath(directory)
    mounts = [ln.split() for ln in open("/proc/mounts")]
    best = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]))
    return dict(dir=str(directory), fs=best[2], device=best[0])


def disk_machine(directory: Path) -> dict:
    """One flat dict for the disk benchmarks' headers: the machine, the versions, the commit and the disk."""
    m, v = machine(), versions()
    return dict(host=m["host"], cpu=m["cpu"], cores=m["cpus"], kernel=platform.release(), mem_gib=m["mem_gib"],
                python=v["python"], torch=v["torch"], commit=commit(short=True), **filesystem(directory))
