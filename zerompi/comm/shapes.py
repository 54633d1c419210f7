"""What every group implementation checks of a collective's tensors, and the bytes it counts.

Collectives take 1-D contiguous tensors (MPI would silently send a strided tensor in memory
order). Bytes sent are counted per rank the way the ZeRO paper counts them: an all-gather or
reduce-scatter of P elements sends (N-1)/N*P elements, an all-reduce twice that. A collective
given ``used`` (per rank, the live elements at the front of its chunk: group.py) counts only those:
an all-gather sends this rank's live elements to N-1 ranks, a reduce-scatter or all-to-all every
other rank's live elements to that rank.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from zerompi.errors import ZeroMPIError

SUM_DTYPES = (torch.float32, torch.float64)  # what MPI_SUM reduces; 16-bit floats are summed in fp32 locally
HALF_DTYPES = (torch.bfloat16, torch.float16)


def check_flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ZeroMPIError(
            f"{name}: collectives take 1-D contiguous tensors, got shape {tuple(t.shape)} "
            f"(contiguous={t.is_contiguous()}); flatten into a FlatBuffer first"
        )


def all_gather_bytes(shard: torch.Tensor | None, out: torch.Tensor, size: int,
                     used: Sequence[int] | None = None, rank: int = 0) -> int:
    check_flat("all_gather out", out)
    if shard is not None:
        check_flat("all_gather shard", shard)
        if shard.numel() * size != out.numel() or shard.dtype != out.dtype:
            raise ZeroMPIError(f"all_gather: shard {shard.numel()} x {size} ranks != out {out.numel()}")
    if used is not None:
        return (size - 1) * _check_used("all_gather", out, size, used)[rank] * out.element_size()
    return (size - 1) * (out.numel() // size) * out.element_size()


def reduce_scatter_bytes(full: torch.Tensor, size: int, used: Sequence[int] | None = None, rank: int = 0) -> int:
    check_flat("reduce_scatter input", full)
    if full.numel() % size:
        raise ZeroMPIError(f"reduce_scatter: {full.numel()} elements do not split over {size} ranks")
    if full.dtype not in SUM_DTYPES + HALF_DTYPES:
        raise ZeroMPIError(f"reduce_scatter: unsupported dtype {full.dtype}")
    if used is not None:
        return _others(_check_used("reduce_scatter", full, size, used), rank) * full.element_size()
    return (size - 1) * (full.numel() // size) * full.element_size()


def all_reduce_bytes(t: torch.Tensor, size: int) -> int:
    check_flat("all_reduce", t)
    if t.dtype not in SUM_DTYPES:
        raise ZeroMPIError(f"all_reduce: MPI cannot sum {t.dtype}; reduce in fp32 "
                           "or use reduce_scatter + all_gather")
    return 2 * (size - 1) * t.numel() * t.element_size() // size


def all_to_all_bytes(send: torch.Tensor, recv: torch.Tensor, size: int,
                     used: Sequence[int] | None = None, rank: int = 0) -> int:
    check_flat("all_to_all send", send)
    check_flat("all_to_all recv", recv)
    if send.numel() != recv.numel() or send.dtype != recv.dtype or send.numel() % size:
        raise ZeroMPIError(f"all_to_all: send {send.numel()} x {send.dtype} and recv {recv.numel()} x "
                           f"{recv.dtype} must match and split over {size} ranks")
    if used is not None:
        return _others(_check_used("all_to_all", send, size, used), rank) * send.element_size()
    return (size - 1) * send.numel() // size * send.element_size()


def gather_bytes(t: torch.Tensor, out: torch.Tensor | None, size: int) -> int:
    """What a non-root rank sends to the root (the root counts nothing: its part stays in place)."""
    check_flat("gather input", t)
    if out is not None:
        check_flat("gather out", out)
        if t.numel() * size != out.numel() or t.dtype != out.dtype:
            raise ZeroMPIError(f"gather: input {t.numel()} x {size} ranks != out {out.numel()}")
    return t.numel() * t.element_size()


def broadcast_bytes(t: torch.Tensor, size: int) -> int:
    """What the root sends (the other ranks send nothing and count nothing)."""
    check_flat("broadcast", t)
    return (size - 1) * t.numel() * t.element_size()


def shift_bytes(t: torch.Tensor, offset: int, size: int) -> int:
    """A shift sends the whole tensor to one other rank (nothing when it lands on the sender)."""
    check_flat("shift", t)
    return 0 if offset % size == 0 else t.numel() * t.element_size()


# ---- counted collectives: live elements at the front of each rank's chunk ------------------

def _check_used(name: str, t: torch.Tensor, size: int, used: Sequence[int]) -> Sequence[int]:
    chunk = t.numel() // size
    if len(used) != size or any(not 0 <= u <= chunk for u in used):
        raise ZeroMPIError(f"{name}: used={list(used)} must give each of {size} ranks at most its "
                           f"chunk of {chunk} elements")
    return used


def _others(used: Sequence[int], rank: int) -> int:
    return sum(used) - used[rank]


def displacements(t: torch.Tensor, size: int) -> list[int]:
    """Where each rank's chunk of ``t`` starts (MPI's displacements of a counted collective)."""
    chunk = t.numel() // size
    return [r * chunk for r in range(size)]


def live(t: torch.Tensor, size: int, used: Sequence[int]) -> torch.Tensor:
    """The live elements of every rank's chunk, back to back (a new tensor)."""
    return torch.cat([c[:u] for c, u in zip(t.view(size, -1), used)])


def clear_padding(t: torch.Tensor, size: int, used: Sequence[int]) -> torch.Tensor:
    """Zero what follows the live elements of every rank's chunk of ``t`` (in place); ``t``."""
    for chunk, u in zip(t.view(size, -1), used):
        chunk[u:].zero_()
    return t
