"""The MPI library itself: the one place that imports mpi4py, and what the rest of comm/ asks of the
library apart from a communicator (the thread level the communication thread needs, the CUDA probes,
the world rank and size). group.py and side.py take ``MPI`` from here."""
from __future__ import annotations

import torch
from mpi4py import MPI

from zerompi.comm import libmpi
from zerompi.comm.cuda_aware import Probes

__all__ = ["MPI", "cuda_probes", "memory_alloc_kinds", "thread_support_error", "world_rank", "world_size"]


def world_rank() -> int:
    """This process's rank in ``MPI_COMM_WORLD``, whatever communicator the engine runs over."""
    return MPI.COMM_WORLD.Get_rank()


def world_size() -> int:
    """The size of ``MPI_COMM_WORLD`` (a group over ``COMM_SELF`` under a multi-rank launch is legitimate)."""
    return MPI.COMM_WORLD.Get_size()


def thread_support_error() -> str | None:
    """Why a communication thread (thread.py) cannot be used with this MPI, or None."""
    provided = MPI.Query_thread()
    if provided >= MPI.THREAD_MULTIPLE:
        return None
    names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
    return (f"mpi_progress='thread' needs MPI_THREAD_MULTIPLE, but MPI was initialised with "
            f"MPI_THREAD_{names.get(provided, provided)} (mpi4py.rc.thread_level, or an MPI built "
            "without thread support); choose mpi_progress='none' or 'test'")


def cuda_probes() -> Probes:
    """Ask the MPI library, three ways, whether it takes CUDA device buffers (cuda_aware.py weighs it)."""
    return Probes(memory_alloc_kinds(), libmpi.mpix_cuda_support(), libmpi.mpix_gpu_cuda_support(),
                  torch.cuda.is_available())


def memory_alloc_kinds() -> str | None:
    """MPI 4.1's ``mpi_memory_alloc_kinds`` of MPI_COMM_WORLD, else of MPI_INFO_ENV; None if neither has it."""
    try:
        info = MPI.COMM_WORLD.Get_info()
        value = info.Get("mpi_memory_alloc_kinds")
        info.Free()
        return value if value is not None else MPI.INFO_ENV.Get("mpi_memory_alloc_kinds")
    except MPI.Exception:  # an MPI older than the key may refuse the query: no answer
        return None
