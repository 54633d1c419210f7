"""The MPI side of surviving a lost rank: ULFM (User-Level Failure Mitigation).

With ``fault_tolerance=True`` a rank's death surfaces on the others as an MPI
error of class ``ERR_PROC_FAILED`` (or ``ERR_REVOKED`` once a peer has revoked
the communicator) from whichever call touched it; :func:`rank_lost` recognises
it. The survivors then :func:`revoke` every communicator of the engine, so that
every rank still waiting in one of them leaves it with an error too, and
:func:`shrink` the engine's communicator to the ranks alive (``MPIX_Comm_shrink``
agrees on the failed set: every survivor gets the same new communicator).

ULFM is part of Open MPI 5 when ``mpiexec --with-ft ulfm`` started the job (it sets
``OMPI_MCA_mpi_ft_enable=1``), with ``--mca async_mpi_finalize 1`` so that the end of
the job does not wait for the lost rank; :func:`support_error` says why it is missing
anywhere else. MPICH implements the same calls, but the PyPI wheel asserts at start-up with
its fault tolerance switched on, so it is refused here rather than half-supported.
mpi4py itself is imported by mpi/library.py alone; this module takes its handle from there.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

from zerompi.comm.libmpi import mpi_function
from zerompi.comm.mpi import MPI, MPIGroup
from zerompi.errors import RankLost

FT_ENV = "OMPI_MCA_mpi_ft_enable"
"""Set to 1 by Open MPI's ``mpiexec --with-ft ulfm`` (or ``--mca mpi_ft_enable 1``)."""
ASYNC_FINALIZE_ENV = "OMPI_MCA_async_mpi_finalize"
"""Set to 1 by ``--mca async_mpi_finalize 1``: MPI_Finalize skips its PMIx fence over every process the job
started, which after a lost rank can wait for it forever (seen in 4 of 25 jobs here, Open MPI
5.0.11: the survivors spin in ompi_mpi_finalize once training is over)."""
LAUNCH_FLAGS = "--with-ft ulfm --mca async_mpi_finalize 1"
LAUNCH_HINT = f"start the job with Open MPI 5's mpiexec {LAUNCH_FLAGS} (jobs/mpirun.sh passes them)"
_ON = ("1", "true", "yes", "on", "enabled")

_LOST_CLASSES = tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                      if hasattr(MPI, name))


def support_error(environ=os.environ, library: str | None = None) -> str | None:
    """Why this MPI (``library``: its version line, default the running one's) cannot survive a lost
    rank, or None when it can."""
    library = library or MPI.Get_library_version().strip().splitlines()[0]
    if "Open MPI" in library:
        if environ.get(FT_ENV, "").strip().lower() not in _ON:
            return f"{library} runs without fault tolerance ({FT_ENV} is not set): {LAUNCH_HINT}"
        if environ.get(ASYNC_FINALIZE_ENV, "").strip().lower() not in _ON:
            return (f"{library}'s MPI_Finalize can wait forever for a lost rank ({ASYNC_FINALIZE_ENV} is not "
                    f"set): {LAUNCH_HINT}")
        if not _LOST_CLASSES or mpi_function("MPIX_Comm_shrink", ctypes.c_int) is None:
            return f"{library} has no MPIX_Comm_shrink (built without ULFM): {LAUNCH_HINT}"
        return None
    if "MPICH" in library:
        return (f"{library}: MPICH's fault tolerance (MPIR_CVAR_ENABLE_FT) is not supported (the PyPI wheel "
                f"asserts at start-up with it on); {LAUNCH_HINT}")
    return f"{library} offers no ULFM zerompi knows of; {LAUNCH_HINT}"


def prepare(group: MPIGroup) -> None:
    """Errors on the group's communicator come back as exceptions instead of aborting the job."""
    for comm in group.communicators:
        comm.Set_errhandler(MPI.ERRORS_RETURN)


def rank_lost(error: BaseException | None, groups: Iterable[object] = (),
              since: BaseException | None = None) -> RankLost | None:
    """A :class:`RankLost` if ``error`` (or an exception it was raised from or during) is an MPI
    error saying that a peer died or the communicator was revoked, or any MPI error while a
    communicator of ``groups`` knows of a failed process or is revoked (a collective whose peer
    died may report only ``ERR_OTHER``); None otherwise. The chain is followed down to ``since``
    alone: an error raised while recovering from ``since`` carries it as its context, and is no
    new loss for that."""
    seen = {id(since)} if since is not None else set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RankLost):
            return error
        if isinstance(error, MPI.Exception):
            if error.Get_error_class() in _LOST_CLASSES:
                return RankLost(f"{error.Get_error_string().strip()} (MPI error class {error.Get_error_class()})")
            failed = _failures(groups)
            if failed:
                return RankLost(f"{error.Get_error_string().strip()}, while {failed}")
        error = error.__cause__ or error.__context__
    return None


def _failures(groups: Iterable[object]) -> str | None:
    """What this process knows of failed peers in ``groups``' communicators (local calls), or None."""
    for g in groups:
        if not isinstance(g, MPIGroup):
            continue
        try:
            if any(c.Is_revoked() for c in g.communicators):
                return f"the {g.label or 'job'} communicator is revoked"
            failed = g.comm.Get_failed()
            try:
                if failed.Get_size():
                    return f"{failed.Get_size()} process(es) of the {g.label or 'job'} communicator failed"
            finally:
                failed.Free()
        except MPI.Exception:  # the query itself failing says as much
            return f"the {g.label or 'job'} communicator cannot be queried"
    return None


def revoke(groups: Iterable[object]) -> None:
    """Revoke the communicator of every MPI group among ``groups`` (once each); peers blocked in one
    of them get ``ERR_REVOKED`` and join the recovery."""
    done = set()
    for g in groups:
        for comm in g.communicators if isinstance(g, MPIGroup) else ():
            if id(comm) not in done:
                done.add(id(comm))
                try:
                    comm.Revoke()
                except MPI.Exception:  # already revoked, or freed: nothing left to tell
                    pass


def shrink(group: MPIGroup) -> tuple[MPIGroup, list[int], list[int]]:
    """Collective over the survivors: a new group of the ranks of ``group`` still alive (in their
    old order), the ranks of ``group`` that are gone, and those ranks' ranks in ``MPI_COMM_WORLD``."""
    comm = group.comm.Shrink()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    old, new, world = group.comm.Get_group(), comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        kept = MPI.Group.Translate_ranks(new, list(range(comm.Get_size())), old)
        lost = sorted(set(range(group.size)) - set(kept))
        in_world = list(MPI.Group.Translate_ranks(old, lost, world)) if lost else []
    finally:
        for g in (old, new, world):
            g.Free()
    survivors = MPIGroup(comm, cuda_aware=group.cuda_aware, debug=group.monitor.agreement.debug,
                         separate_metadata=group.metadata_comm is not None)
    prepare(survivors)
    return survivors, lost, in_world
