"""Where this process stands in the job: rank, local rank, threads, device, seeds.

Everything comes from MPI itself (``MPI_COMM_TYPE_SHARED`` gives the ranks of
this node), so the same code runs under ``mpiexec``, ``mpirun`` or ``srun``
without reading any launcher's environment variables.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from zerompi.comm.cuda_aware import decide
from zerompi.comm.group import ProcessGroup
from zerompi.comm.mpi import cuda_probes, world_rank, world_size
from zerompi.config.choices import CudaAware, Device
from zerompi.errors import ConfigError
from zerompi.comm.launch_check import check_world_matches_launcher
from zerompi.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the data-parallel group and on its node."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int


def discover(group: ProcessGroup) -> RankInfo:
    """Collective: rank, local rank and node index of every process in ``group``."""
    # MPI_COMM_WORLD's size, not the group's: comm=COMM_SELF under a multi-rank launch is legitimate
    check_world_matches_launcher(world_size())
    local = group.split_shared()
    leaders = group.allgather_object(group.rank if local.rank == 0 else None)
    leader_ranks = sorted(r for r in leaders if r is not None)
    my_leader = local.allgather_object(group.rank if local.rank == 0 else None)[0]
    info = RankInfo(group.rank, group.size, local.rank, local.size,
                    leader_ranks.index(my_leader), len(leader_ranks))
    local.free()
    return info


def cpu_threads_for(requested: int | None, local_size: int) -> int:
    """One share of this node's cores per rank, unless the config says otherwise."""
    if requested is not None:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_size))


def select_device(kind: Device, local_rank: int) -> torch.device:
    """``auto``: this rank's GPU by local rank when CUDA is available, else the CPU."""
    if kind == Device.CPU or (kind == Device.AUTO and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch.cuda.is_available() is False on this rank")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def use_cuda_aware(setting: CudaAware) -> bool:
    """Whether device buffers go straight to MPI (cuda_aware.py); the choice and its reason go to the log once.

    Raises ConfigError for ``on`` with an MPI that reports no CUDA support.
    """
    decision = decide(setting, cuda_probes())
    if world_rank() == 0:  # MPI_COMM_WORLD's rank: set_rank has not run yet
        path = "go to MPI directly" if decision.use else "are staged through pinned host memory"
        logger.info("device buffers %s: %s", path, decision.reason)
    return decision.use


def seed_rank(seed: int, rank: int) -> None:
    """Per-rank RNG streams (dropout differs across ranks, as it does across samples)."""
    torch.manual_seed(seed + rank)
