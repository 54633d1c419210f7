"""Starting an MPI job from Python: which ``mpiexec``, and the environment its ranks get.

The tests and the benchmarks both start real jobs (``mpiexec -n N python -m
mpi4py SCRIPT``) and share these two functions; each keeps its own runner.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=None)
def mpiexec() -> list[str]:
    """The mpiexec beside this Python (the pip MPI), else ``$ZEROMPI_MPIEXEC`` or PATH's."""
    exe = os.environ.get("ZEROMPI_MPIEXEC") or str(Path(sys.executable).with_name("mpiexec"))
    if not Path(exe).exists():
        exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("no mpiexec found: install the 'mpich' extra or load your site's MPI")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        return [exe, "--oversubscribe"]
    return [exe]


def mpi_env(root: Path) -> dict[str, str]:
    """This process's environment for ranks that import the package from ``root``: one torch
    thread per rank, MPICH ranks that yield the core while they wait, Open MPI allowed as root."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    # Oversubscribed MPICH ranks busy-poll; yielding early leaves the cores to ranks with work.
    env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "1")
    env.setdefault("MPIR_CVAR_POSIX_POLL_FREQUENCY", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_btl", "self,sm")
    return env
