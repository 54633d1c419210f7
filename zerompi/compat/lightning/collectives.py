"""Lightning's collectives (``reduce``, ``all_gather``, ``broadcast``, ``barrier``) over a zerompi group.

The strategy runs them on a communicator split off the engine's group (the same ranks), so that
a metric synchronised inside ``training_step`` never interleaves with the engine's own gathers and
reductions, which may be in flight on its communication thread. Each rank's values are gathered
and folded locally in rank order, so every rank holds the same bits, in any dtype.
"""
from __future__ import annotations

from typing import Any

import torch

from zerompi.comm.group import ProcessGroup
from zerompi.errors import UsageError

_OPS = {"sum": "sum", "mean": "mean", "avg": "mean", "max": "max", "min": "min"}


def op_name(reduce_op: Any) -> str:
    """'sum', 'mean', 'max' or 'min' for Lightning's reduce_op (a string or a torch ReduceOp)."""
    if reduce_op is None:
        return "mean"
    raw = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", None) or str(reduce_op)
    name = str(raw).lower().rsplit(".", 1)[-1]
    if name not in _OPS:
        raise UsageError(f"ZeroMPIStrategy.reduce(reduce_op={reduce_op!r}): allowed sum, mean (avg), max, min")
    return _OPS[name]


def no_subgroup(group: Any, verb: str) -> None:
    if group is not None:
        raise UsageError(f"ZeroMPIStrategy.{verb}(group={group!r}): only the whole job's group exists "
                         "(zerompi is data parallel only); pass group=None")


def gather_rows(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape on every rank), stacked in rank order: shape (ranks, *shape)."""
    t = tensor.detach()
    as_bool = t.dtype == torch.bool
    flat = (t.to(torch.uint8) if as_bool else t).reshape(-1).contiguous()
    out = torch.empty(group.size * flat.numel(), dtype=flat.dtype, device=flat.device)
    group.all_gather(flat, out, kind="lightning", what="ZeroMPIStrategy collective")
    out = out.view(group.size, *t.shape)
    return out.bool() if as_bool else out


def reduce(tensor: torch.Tensor, group: ProcessGroup, reduce_op: Any = "mean") -> torch.Tensor:
    """``tensor`` reduced over the ranks (a new tensor; a mean of integers is a float)."""
    name = op_name(reduce_op)
    rows = gather_rows(tensor, group)
    if name in ("max", "min"):
        return rows.amax(dim=0) if name == "max" else rows.amin(dim=0)
    if name == "mean" and not (rows.is_floating_point() or rows.is_complex()):
        rows = rows.to(torch.get_default_dtype())
    out = rows[0].clone()
    for row in rows[1:]:  # rank order: the same bits on every rank
        out = out + row
    return out / group.size if name == "mean" else out


def broadcast(obj: Any, src: int, group: ProcessGroup) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank."""
    if not 0 <= src < group.size:
        raise UsageError(f"ZeroMPIStrategy.broadcast(src={src}): the job has ranks 0..{group.size - 1}")
    return group.allgather_object(obj if group.rank == src else None)[src]
