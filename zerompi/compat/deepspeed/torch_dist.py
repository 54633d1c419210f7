"""``torch.distributed`` under plain ``mpiexec``: a default process group over zerompi's MPI group.

DeepSpeed scripts call ``torch.distributed`` themselves (``get_rank()``, ``barrier()``, a loss
``all_reduce``). DeepSpeed makes its default group with a TCP rendezvous; here
``init_distributed()`` registers a torch backend written in Python, ``"zerompi_mpi"``, whose
process group runs every collective over an MPI group (the one ``deepspeed.comm`` uses, split off
``MPI_COMM_WORLD``), and calls ``torch.distributed.init_process_group`` with it and an in-memory
store: no address, no port, no rendezvous.

Collectives block and return a finished handle (``async_op=True`` gives a ``Work`` whose ``wait()``
has nothing left to do). Reductions gather every rank's values and fold them locally in rank
order, so every rank computes the same bits, for any dtype and ``ReduceOp``; they are meant for a
script's metrics and small tensors, not for bulk data (the engine reduces gradients itself).
Sub-groups (``new_group``) are made with ``MPI_Comm_create_group`` over their ranks.
Point-to-point calls (``send``/``recv``) are not offered.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from zerompi.comm.group import ProcessGroup as ZeroGroup
from zerompi.errors import UsageError
from zerompi.torch_private import create_work_from_future

__all__ = ["BACKEND", "MPIProcessGroup", "ensure_default_group"]

BACKEND = "zerompi_mpi"
"""The torch.distributed backend name (``torch.distributed.get_backend()`` answers it)."""


def _fold(stacked: torch.Tensor, op: Any) -> torch.Tensor:
    """``stacked`` (ranks first) reduced by torch's ``op``, rank by rank in rank order."""
    name = str(op).split(".")[-1].upper() if not hasattr(op, "name") else op.name.upper()
    if name == "AVG":
        if not (stacked.is_floating_point() or stacked.is_complex()):
            raise UsageError("all_reduce(op=AVG) needs a floating tensor")
        return _fold(stacked, "SUM") / stacked.shape[0]
    fn = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
          "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}.get(name)
    if fn is None:
        raise UsageError(f"torch.distributed reduction {op}: allowed SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR")
    out = stacked[0].clone()
    for row in stacked[1:]:
        out = fn(out, row)
    return out


def _op_name(opts: Any) -> str:
    op = opts.reduceOp
    op = getattr(op, "op", op)  # a ReduceOp object wraps a RedOpType
    return str(op).split(".")[-1].upper()


def _finished(result: Any = None) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    return create_work_from_future(fut)


class MPIProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives run over a zerompi :class:`~zerompi.comm.group.ProcessGroup`."""

    def __init__(self, group: ZeroGroup):
        super().__init__(group.rank, group.size)
        self.group = group

    # ---- helpers ----------------------------------------------------------
    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, stacked in rank order: (ranks, *shape)."""
        flat = tensor.detach().reshape(-1).contiguous()
        out = torch.empty(self.group.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        if flat.numel():
            self.group.all_gather(flat, out, kind="script", what="torch.distributed")
        return out.view(self.group.size, *tensor.shape)

    @staticmethod
    def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.no_grad():
            dst.copy_(src.view(dst.shape))

    # ---- collectives --------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        name = _op_name(opts) if opts is not None else "SUM"
        for t in tensors:
            self._write(t, _fold(self._gather(t), name))
        return _finished(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        name = _op_name(opts)
        for t in tensors:
            reduced = _fold(self._gather(t), name)
            if self.group.rank == opts.rootRank:
                self._write(t, reduced)
        return _finished(tensors)

    def broadcast(self, tensors, opts):
        for t in tensors:
            flat = t.detach().reshape(-1).contiguous()
            if flat.numel():
                self.group.broadcast(flat, opts.rootRank, kind="script", what="torch.distributed.broadcast")
            if flat.data_ptr() != t.data_ptr():
                self._write(t, flat)
        return _finished(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, t in zip(output_tensors, input_tensors):
            for out, row in zip(outs, self._gather(t)):
                self._write(out, row)
        return _finished(output_tensors)

    def all_gather_single(self, output, input, opts=None):
        self._write(output, self._gather(input))
        return _finished([output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for out, t in zip(outputs, inputs):
            self.all_gather_single(out, t, opts)
        return _finished(outputs)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def gather(self, output_tensors, input_tensors, opts):
        for i, t in enumerate(input_tensors):
            rows = self._gather(t)
            if self.group.rank == opts.rootRank:
                for out, row in zip(output_tensors[i], rows):
                    self._write(out, row)
        return _finished(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        for i, out in enumerate(output_tensors):
            if self.group.rank == opts.rootRank:
                full = torch.stack([x.detach().reshape(out.shape) for x in input_tensors[i]]).reshape(-1)
            else:
                full = torch.empty(self.group.size * out.numel(), dtype=out.dtype, device=out.device)
            if full.numel():
                self.group.broadcast(full.contiguous(), opts.rootRank, kind="script",
                                     what="torch.distributed.scatter")
            self._write(out, full.view(self.group.size, -1)[self.group.rank])
        return _finished(output_tensors)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        name = _op_name(opts)
        for out, parts in zip(output_tensors, input_tensors):
            summed = _fold(self._gather(torch.stack([p.reshape(out.shape) for p in parts])), name)
            self._write(out, summed[self.group.rank])  # (ranks, world, ...) folded over the ranks
        return _finished(output_tensors)

    def reduce_scatter_single(self, output, input, opts):
        name = _op_name(opts)
        self._write(output, _fold(self._gather(input), name).view(self.group.size, -1)[self.group.rank])
        return _finished([output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        for out, t in zip(outputs, inputs):
            self.reduce_scatter_single(out, t, opts)
        return _finished(outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if output_split_sizes or input_split_sizes:
            raise UsageError("all_to_all_single with split sizes is not supported over zerompi_mpi")
        send = input.detach().reshape(-1).contiguous()
        recv = torch.empty_like(send)
        if send.numel():
            self.group.all_to_all(send, recv, kind="script", what="torch.distributed.all_to_all_single")
        self._write(output, recv)
        return _finished([output])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        for dest, t in enumerate(input_tensors):  # what every rank sends to rank ``dest``
            rows = self._gather(t)
            if dest == self.group.rank:
                for out, row in zip(output_tensors, rows):
                    self._write(out, row)
        return _finished(output_tensors)

    def barrier(self, opts=None):
        self.group.barrier()
        return _finished()

    def shutdown(self) -> None:
        """``destroy_process_group``: the MPI group stays (deepspeed.comm's, or freed with its sub-group)."""

    def abort(self) -> None:
        self.group.abort(1)

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"MPIProcessGroup(rank={self.group.rank}, size={self.group.size})"


_WORLD: ZeroGroup | None = None  # the group the default torch process group runs over
_DEFAULT_PENDING = [False]  # set while init_process_group makes the default group


def _create(opts: Any, backend_opts: Any) -> MPIProcessGroup:
    """torch's backend factory (extended API): the world group, or a sub-group of its ranks."""
    if _WORLD is None:
        raise UsageError(f"torch.distributed backend {BACKEND!r} is made by deepspeed.init_distributed(), "
                         "not by init_process_group")
    ranks = list(opts.global_ranks_in_group)
    if _DEFAULT_PENDING[0]:  # the default group itself
        _DEFAULT_PENDING[0] = False
        return MPIProcessGroup(_WORLD)
    return MPIProcessGroup(_WORLD.create_group(ranks or list(range(_WORLD.size))))


@functools.cache
def _register() -> None:
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def ensure_default_group(group: ZeroGroup) -> None:
    """Collective: make ``group`` (every rank of the job) torch.distributed's default process group,
    unless the script has made one itself."""
    global _WORLD
    if dist.is_initialized():
        return
    _register()
    _WORLD = group
    _DEFAULT_PENDING[0] = True
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=group.rank, world_size=group.size,
                            timeout=timedelta(days=1))
