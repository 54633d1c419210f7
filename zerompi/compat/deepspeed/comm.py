"""``deepspeed.comm`` over zerompi's MPI process group: ranks, barrier and the collectives scripts call.

DeepSpeed's calls run over ``torch.distributed``; here they run over an MPI group of every
rank of ``MPI_COMM_WORLD``, on a communicator split off for them, so that a script's own
collectives never interleave with the engine's (which may run on a communication thread).
The ranks need no rendezvous: ``init_distributed()`` learns where each rank runs, sets
DeepSpeed's environment variables and makes torch.distributed's default process group, over the
same MPI group (torch_dist.py); ``initialize`` calls it too. Rank and world size
answer before it, as MPI knows them from the start.

Collectives take any dtype: each rank's values are gathered and reduced locally in rank
order (``all_reduce`` is meant for a script's metrics, not for bulk data). Only the world
group exists (``group=None``), and every call completes before it returns (an ``async_op``
handle's ``wait()`` has nothing left to do).
"""
from __future__ import annotations

import os
import socket
from enum import Enum
from typing import Any

import torch

from zerompi.comm import launch
from zerompi.compat.deepspeed import torch_dist
from zerompi.comm.group import ProcessGroup, Work
from zerompi.comm.mpi import MPIGroup, world_rank
from zerompi.comm.mpi import world_size as mpi_world_size
from zerompi.errors import UsageError

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "barrier",
           "broadcast", "broadcast_object_list", "get_local_rank", "get_rank", "get_world_group",
           "get_world_size", "init_distributed", "is_available", "is_initialized", "set_environment"]


class ReduceOp(Enum):
    """DeepSpeed's reduction operators (``deepspeed.comm.ReduceOp``)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


_REDUCE = {
    "SUM": lambda x: _ordered(x, torch.add), "PRODUCT": lambda x: _ordered(x, torch.mul),
    "MIN": lambda x: x.amin(dim=0), "MAX": lambda x: x.amax(dim=0),
    "BAND": lambda x: _ordered(x, torch.bitwise_and), "BOR": lambda x: _ordered(x, torch.bitwise_or),
    "BXOR": lambda x: _ordered(x, torch.bitwise_xor),
}

_group: ProcessGroup | None = None
_info: launch.RankInfo | None = None


def _ordered(stacked: torch.Tensor, fn) -> torch.Tensor:
    """Fold the ranks' rows in rank order, so every rank computes the same bits."""
    out = stacked[0].clone()
    for row in stacked[1:]:
        out = fn(out, row)
    return out


def _only_world(group: Any) -> None:
    if group is not None and (_group is None or group is not _group) and not _is_torch_world(group):
        raise UsageError("deepspeed.comm: only the world group (group=None) exists under zerompi, which is "
                         "data parallel only")


def _world(group: Any = None) -> ProcessGroup:
    """The scripts' group (made at the first collective, which every rank calls)."""
    global _group
    _only_world(group)
    if _group is None:
        _group = MPIGroup().split(0, world_rank(), "")  # a communicator of its own, same ranks
    return _group


def world_group() -> ProcessGroup:
    """The scripts' group (collective the first time)."""
    return _world()


def _is_torch_world(group: Any) -> bool:
    """Whether ``group`` is torch.distributed's default group (``dist.group.WORLD``), which runs over ours."""
    import torch.distributed as dist
    return dist.is_initialized() and group is dist.group.WORLD


def _done(async_op: bool) -> Work | None:
    return Work.done() if async_op else None


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    """Whether ``init_distributed`` (or ``initialize``) has run."""
    import torch.distributed as dist
    return _info is not None and dist.is_initialized()


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout: Any = None,
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config: Any = None, rank: int = -1, world_size: int = -1) -> None:
    """Collective: learn each rank's place (MPI started and connected the ranks), set
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE`` and ``LOCAL_WORLD_SIZE``, as DeepSpeed's
    MPI discovery does, and give torch.distributed a default process group over MPI (torch_dist.py;
    kept if the script made one itself). The backend, port and rendezvous arguments have nothing to
    choose here; ``rank`` and ``world_size``, when given, must be MPI's. Later calls change nothing."""
    for name, given, actual in (("rank", rank, world_rank()), ("world_size", world_size, mpi_world_size())):
        if given not in (-1, actual):
            raise UsageError(f"init_distributed({name}={given}): MPI gives this process {name} {actual}")
    set_environment()
    torch_dist.ensure_default_group(_world())


def set_environment() -> None:
    """Collective, once: learn where each rank runs and set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_SIZE`` and ``LOCAL_WORLD_SIZE`` (what DeepSpeed's launcher gives a script before it starts),
    and ``MASTER_ADDR`` and ``MASTER_PORT`` where they are not set."""
    global _info
    if _info is not None:
        return
    _info = launch.discover(_world())
    os.environ.update(RANK=str(_info.rank), LOCAL_RANK=str(_info.local_rank), WORLD_SIZE=str(_info.world_size),
                      LOCAL_SIZE=str(_info.local_size), LOCAL_WORLD_SIZE=str(_info.local_size))
    # A torch.distributed group a framework builds itself (gloo on the CPU: Accelerate's use_cpu, the
    # Trainer's --use_cpu) rendezvouses at MASTER_ADDR:MASTER_PORT, which DeepSpeed's MPI discovery sets:
    # rank 0's host (loopback on one node) and a port free there, agreed over MPI. Values given are kept.
    offer = _rendezvous(_info.num_nodes) if _info.rank == 0 else None
    addr, port = _world().allgather_object(offer)[0]
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))


def _rendezvous(nodes: int) -> tuple[str, int]:
    """Rank 0's address for the other ranks and a TCP port free on it now."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ("127.0.0.1" if nodes == 1 else socket.gethostname()), port


def get_rank(group: Any = None) -> int:
    _only_world(group)
    return world_rank()


def get_world_size(group: Any = None) -> int:
    _only_world(group)
    return mpi_world_size()


def get_local_rank() -> int:
    """This rank's index on its node (``init_distributed`` learns it; ``LOCAL_RANK`` before that)."""
    if _info is not None:
        return _info.local_rank
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    raise UsageError("deepspeed.comm.get_local_rank() before init_distributed(): call "
                     "deepspeed.init_distributed() first (collective: it finds the ranks of each node)")


def get_world_group() -> ProcessGroup:
    return _world()


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    _world(group).barrier()
    return _done(async_op)


def _gather(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor``, stacked in rank order: shape (ranks, numel)."""
    flat = tensor.detach().reshape(-1).contiguous()
    out = torch.empty(group.size * flat.numel(), dtype=flat.dtype, device=flat.device)
    group.all_gather(flat, out, kind="script", what="deepspeed.comm")
    return out.view(group.size, flat.numel())


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               **kwargs: Any) -> Work | None:
    """In place: ``tensor`` reduced over the ranks by ``op`` (DeepSpeed's or torch.distributed's ReduceOp)."""
    name = getattr(op, "name", str(op)).upper()
    if name not in _REDUCE and name != "AVG":
        raise UsageError(f"all_reduce(op={op!r}): allowed SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR")
    g = _world(group)
    stacked = _gather(tensor, g)
    if name == "AVG":
        reduced = _REDUCE["SUM"](stacked) / g.size
    else:
        reduced = _REDUCE[name](stacked)
    with torch.no_grad():
        tensor.copy_(reduced.view(tensor.shape))
    return _done(async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              **kwargs: Any) -> Work | None:
    """In place: ``tensor`` takes rank ``src``'s values."""
    flat = tensor.detach().reshape(-1).contiguous()
    _world(group).broadcast(flat, src, kind="script", what="deepspeed.comm.broadcast")
    if flat.data_ptr() != tensor.data_ptr():
        with torch.no_grad():
            tensor.copy_(flat.view(tensor.shape))
    return _done(async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False, **kwargs: Any) -> Work | None:
    """``tensor_list[r]`` = rank r's ``tensor``."""
    g = _world(group)
    if len(tensor_list) != g.size:
        raise UsageError(f"all_gather: tensor_list has {len(tensor_list)} tensors for {g.size} ranks")
    with torch.no_grad():
        for out, row in zip(tensor_list, _gather(tensor, g)):
            out.copy_(row.view(out.shape))
    return _done(async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, **kwargs: Any) -> Work | None:
    """``output_tensor`` = the ranks' ``tensor``s concatenated along the first dimension."""
    with torch.no_grad():
        output_tensor.copy_(_gather(tensor, _world(group)).view(output_tensor.shape))
    return _done(async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, **kwargs: Any) -> None:
    """``object_list[r]`` = rank r's picklable ``obj``."""
    object_list[:] = _world(group).allgather_object(obj)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, **kwargs: Any) -> None:
    """``object_list`` takes rank ``src``'s picklable items."""
    object_list[:] = _world(group).allgather_object(list(object_list))[src]
