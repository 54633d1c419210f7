"""Collectives that carry block-wise integer codes (codec.py) instead of the values: ZeRO++'s qwZ and qgZ.

What crosses is exactly the packed chunks, codes and scales, so the group's byte
counters see what is sent, under the kind ``<kind>.<codec>`` (monitor.py's
``compressed_kind``: ``all_gather.int8``, ``reduce_scatter.int4@intra``, ...).

* ``reduce_scatter``: each rank encodes its whole buffer as one chunk per rank
  (after adding its error-feedback residual, which the encoding then refreshes),
  an all-to-all moves chunk r to rank r, and rank r decodes the chunks it got and
  sums them in fp32 over the rank dimension, the arithmetic of the 16-bit
  reduce-scatter (mpi/group.py): deterministic, the same on every run.
* ``all_gather``: the owners encoded their chunks beforehand (parameters: once
  per step, see shard/compression.py); the packed chunks are gathered and every
  rank decodes all of them, its own included, so every rank holds the same values.

Both return a :class:`~zerompi.comm.group.Work` whose ``wait()`` decodes once
the data has moved, so they overlap like the uncompressed verbs.
"""
from __future__ import annotations

import torch

from zerompi.comm.codec import BlockCodec
from zerompi.comm.group import ProcessGroup, ThenWork, Work
from zerompi.comm.monitor import compressed_kind


class CompressedGroup:
    """A group's all_gather and reduce_scatter, carrying ``codec``'s packed chunks."""

    def __init__(self, group: ProcessGroup, codec: BlockCodec):
        self.group, self.codec = group, codec

    def reduce_scatter(self, full: torch.Tensor, *, residual: torch.Tensor | None = None, async_op: bool = False,
                       what: str = "") -> Work:
        """Sum ``full`` (any float dtype) over ranks; ``wait()`` returns this rank's chunk in fp32.

        ``residual`` (fp32, the size of ``full``): error feedback. It is added to what is sent and
        then holds what the encoding dropped, for the next reduction to send."""
        size = self.group.size
        if full.numel() % size:
            raise ValueError(f"reduce_scatter: {full.numel()} elements do not split over {size} ranks")
        n = full.numel() // size
        packed = self.codec.encode(full if residual is None else full.float() + residual, n, residual)
        recv = torch.empty_like(packed)
        work = self.group.all_to_all(packed, recv, kind=compressed_kind("reduce_scatter", self.codec.name),
                                     async_op=async_op, what=what)
        return _then(work, lambda: self.codec.decode(recv, n).sum(dim=0), async_op)

    def all_gather(self, packed: torch.Tensor, out: torch.Tensor, *, chunk: int, async_op: bool = False,
                   what: str = "") -> Work:
        """``out`` = every rank's ``packed`` chunks of ``chunk`` values, decoded, in rank order (a rank may
        send several chunks: hpZ's node-local copy holds one per node)."""
        gathered = torch.empty(packed.numel() * self.group.size, dtype=torch.uint8, device=packed.device)
        work = self.group.all_gather(packed, gathered, kind=compressed_kind("all_gather", self.codec.name),
                                     async_op=async_op, what=what)
        return _then(work, lambda: out.copy_(self.codec.decode(gathered, chunk).reshape(-1)), async_op)

    def all_gather_packed(self, packed: torch.Tensor, out: torch.Tensor, *, what: str = "") -> None:
        """``out`` = every rank's packed chunks, still packed (hpZ builds its node-local copy so)."""
        self.group.all_gather(packed, out, kind=compressed_kind("all_gather", self.codec.name), what=what)


def _then(work: Work, decode, async_op: bool) -> Work:
    """``work`` followed by ``decode``, done before returning unless ``async_op`` (as a blocking verb's result is)."""
    then = ThenWork(work, decode)
    if not async_op:
        then.wait()
    return then
