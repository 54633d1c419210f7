"""Record every collective a row issues during its timed steps: op, size, and the function called.

Used by ``bench_transport.py``: a row run with ``--trace`` (see rowlib) writes the list of
collectives rank 0 issued in its timed steps, which the transport benchmark then replays on
MPICH shared memory and on gloo over TCP. Tracing is off in timed rows.

Each call is recorded as ``{"op", "fn", "numel", "itemsize", "n", "async_op"}``: ``op`` the
canonical collective (all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all),
``fn`` the function the framework called (``ProcessGroup.*`` for zerompi's), ``numel`` the
elements of the *full* tensor (the reduce-scatter input, the all-gather output, the
all-reduced tensor), ``n`` the group size.

- torch.distributed rows: commcount's wrappers call :func:`record` (FSDP2, DeepSpeed and
  ZeroRedundancyOptimizer call the collectives through the ``torch.distributed`` namespace);
  DDP all-reduces its buckets in C++, so in trace mode run_ddp registers torch's own
  ``allreduce_hook``, whose ``dist.all_reduce`` of each bucket the wrappers see.
- zerompi rows: :func:`install_zerompi` wraps ``ProcessGroup.all_gather`` / ``reduce_scatter`` /
  ``all_reduce`` / ``broadcast`` (every collective zerompi issues goes through them).
"""
from __future__ import annotations

import functools

CALLS: list[dict] = []
_on = False

OPS = {  # function called -> canonical collective
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter", "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
    "broadcast": "broadcast", "reduce": "reduce", "all_to_all_single": "all_to_all",
}


def start() -> None:
    """Clear the record and start recording (rowlib: after the warm-up steps)."""
    global _on
    CALLS.clear()
    _on = True


def on() -> bool:
    return _on


def stop() -> list[dict]:
    global _on
    _on = False
    return list(CALLS)


def record(op: str, fn: str, numel: int, itemsize: int, n: int, **extra) -> None:
    if _on:
        CALLS.append(dict(op=op, fn=fn, numel=int(numel), itemsize=int(itemsize), n=int(n), **extra))


def _numel(t) -> int:
    import torch
    return t.numel() if isinstance(t, torch.Tensor) else sum(_numel(x) for x in t)


def _itemsize(t) -> int:
    import torch
    return t.element_size() if isinstance(t, torch.Tensor) else _itemsize(t[0])


def record_torch(fn: str, a: dict, n: int) -> None:
    """One torch.distributed call, from its bound arguments (commcount's wrapper)."""
    if fn in ("all_reduce", "broadcast", "reduce"):
        t = a["tensor"]
    elif fn == "all_reduce_coalesced":
        t = a["tensors"]
    elif fn in ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single"):
        t = a["input"]
    elif fn == "reduce_scatter":
        t = a["input_list"]
    elif fn in ("all_gather_single", "all_gather_into_tensor"):
        t = a["output_tensor"]
    elif fn == "all_gather":
        t = a["tensor_list"]
    else:
        return
    record(OPS[fn], fn, _numel(t), _itemsize(t), n, async_op=bool(a.get("async_op", False)))


def install_zerompi() -> None:
    """Wrap zerompi's ProcessGroup collectives so that each call is recorded (idempotent)."""
    from zerompi.comm.mpi import MPIGroup

    def wrap(name: str, full):
        fn = getattr(MPIGroup, name)
        if getattr(fn, "__traced__", False):
            return

        @functools.wraps(fn)
        def traced(self, *args, **kwargs):
            t = full(self, *args, **kwargs)
            record(name, f"ProcessGroup.{name}", t.numel(), t.element_size(), self.size,
                   kind=kwargs.get("kind", name),
                   async_op=bool(kwargs.get("async_op", False)))
            return fn(self, *args, **kwargs)
        traced.__traced__ = True
        setattr(MPIGroup, name, traced)

    wrap("all_gather", lambda self, shard, out, **kw: out)
    wrap("reduce_scatter", lambda self, full, **kw: full)
    wrap("all_reduce", lambda self, t, **kw: t)
    wrap("broadcast", lambda self, t, root=0, **kw: t)


def summary(calls: list[dict]) -> dict[str, dict]:
    """Per op: number of calls and bytes of the full tensors."""
    out: dict[str, dict] = {}
    for c in calls:
        s = out.setdefault(c["op"], dict(calls=0, bytes=0))
        s["calls"] += 1
        s["bytes"] += c["numel"] * c["itemsize"]
    return out
