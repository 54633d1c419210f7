"""MPI under the collectives, cut along its concerns: the library (library.py, the one importer of
mpi4py), the group's collectives (group.py) and the hang report's side channel (side.py)."""
from zerompi.comm.mpi.group import MPIGroup
from zerompi.comm.mpi.library import (
    MPI,
    cuda_probes,
    memory_alloc_kinds,
    thread_support_error,
    world_rank,
    world_size,
)

__all__ = ["MPI", "MPIGroup", "cuda_probes", "memory_alloc_kinds", "thread_support_error", "world_rank", "world_size"]
