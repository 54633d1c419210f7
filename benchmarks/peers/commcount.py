"""Count the bytes torch.distributed collectives send, the way zerompi's counters do.

:func:`install` wraps the collectives in the ``torch.distributed`` namespace
(FSDP2, ZeroRedundancyOptimizer and DeepSpeed's comm layer call them through it;
install before DeepSpeed initialises, as it keeps references). Each call adds
what this rank sends under the ring-equivalent convention of zerompi's
``engine.stats.bytes_sent``, with N ranks and a tensor of B bytes:

    all-reduce 2(N-1)/N·B   reduce-scatter (N-1)/N·B of the full input
    all-gather (N-1)·B of this rank's shard   broadcast (N-1)·B at the root
    reduce B at every rank but the destination   all-to-all (N-1)/N·B

Averaged over ranks, broadcast and reduce give (N-1)/N·B, as in a ring. DDP's
gradient all-reduce runs in C++ and is not seen here; its runner adds it from
the algorithm (every gradient all-reduced once per step).
"""
from __future__ import annotations

import functools
import inspect
from collections import defaultdict

import torch

import calltrace

COUNTS: dict[str, int] = defaultdict(int)


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(_nbytes(x) for x in t)  # a list of tensors


def _world(group) -> int:
    import torch.distributed as dist
    return dist.get_world_size(group)


def _rank(group) -> int:
    import torch.distributed as dist
    return dist.get_rank(group)


def _is_root(a: dict, key: str) -> bool:
    """Whether this rank is the src/dst of a rooted collective (global or group rank)."""
    import torch.distributed as dist
    if a.get(f"group_{key}") is not None:
        return a[f"group_{key}"] == _rank(a.get("group"))
    return a.get(key) == dist.get_rank()


def _sent(name: str, a: dict) -> int:
    n = _world(a.get("group"))
    if name in ("all_reduce", "all_reduce_coalesced"):
        return 2 * (n - 1) * _nbytes(a["tensor"] if "tensor" in a else a["tensors"]) // n
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return (n - 1) * _nbytes(a["input"]) // n
    if name == "reduce_scatter":
        return (n - 1) * _nbytes(a["input_list"]) // n
    if name in ("all_gather_single", "all_gather_into_tensor"):
        return (n - 1) * _nbytes(a["input_tensor"])
    if name == "all_gather":
        return (n - 1) * _nbytes(a["tensor"])
    if name == "broadcast":
        return (n - 1) * _nbytes(a["tensor"]) if _is_root(a, "src") else 0
    if name == "reduce":
        return 0 if _is_root(a, "dst") else _nbytes(a["tensor"])
    if name == "all_to_all_single":
        return (n - 1) * _nbytes(a["input"]) // n
    return 0


KINDS = {  # function -> the kind it is counted under (zerompi's kind names where they exist)
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter", "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather": "all_gather",
    "broadcast": "broadcast", "reduce": "reduce", "all_to_all_single": "all_to_all",
}


def _wrap(name: str, fn):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def counted(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        COUNTS[KINDS[name]] += _sent(name, bound.arguments)
        if calltrace.on():  # bench_transport's trace runs only
            calltrace.record_torch(name, bound.arguments, _world(bound.arguments.get("group")))
        return fn(*args, **kwargs)
    counted.__wrapped_for_counting__ = True
    return counted


def install() -> None:
    """Wrap the collectives of ``torch.distributed`` (idempotent)."""
    import torch.distributed as dist
    for name in KINDS:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__wrapped_for_counting__", False):
            setattr(dist, name, _wrap(name, fn))


def bytes_sent() -> dict[str, int]:
    return dict(COUNTS)
