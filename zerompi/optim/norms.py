"""How the optimizer measures the global gradient norm: one strategy, chosen once at construction.

``SumOfSquares`` adds each rank's fp32 sum of squares with one all-reduce: cheap, and its last bits
depend on how the elements are split over the ranks. ``ExactChunks`` (reproducible=True) gathers
every rank's fp64 sums of whole 1024-element chunks and adds them with ``math.fsum``, exactly, so the
norm (and the clip coefficient) is the same at any world size.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from zerompi.comm.group import ProcessGroup


class GradNorm(Protocol):
    def __call__(self, buckets: list, scale: float, early: dict[int, float]) -> float:
        """The global L2 norm of the unscaled gradient (``scale``: the fp16 loss scale; ``early``: the
        squared norms of buckets already updated in backward, by bucket index)."""


class SumOfSquares:
    """Each rank's sum of squares, all-reduced over the shard group (whose shards cover every element
    once; hsdp replicas would repeat it); with a replicated optimizer every rank has it all."""

    def __init__(self, replicated: bool, group: ProcessGroup):
        self.replicated, self.group = replicated, group

    def __call__(self, buckets: list, scale: float, early: dict[int, float]) -> float:
        local = sum(early[i] if i in early else b.grads.norm_sq(scale) for i, b in enumerate(buckets))
        if not self.replicated:
            local = self.group.sum_floats([local], what="the global gradient norm")[0]
        return math.sqrt(local)


class ExactChunks:
    """reproducible=True: each rank takes the fp64 sum of squares of every chunk of its shards (shards are
    whole chunks, so a chunk's elements are the same at any N), all ranks gather them, and math.fsum adds
    them exactly, so neither their order nor the padding's zero chunks matter. The loss is not scaled in
    this mode (fp16 is refused) and nothing is updated in backward, so ``scale`` and ``early`` are unused."""

    def __init__(self, group: ProcessGroup):
        self.group = group

    def __call__(self, buckets: list, scale: float, early: dict[int, float]) -> float:
        local = torch.cat([b.grads.chunk_sq() for b in buckets])
        group = self.group
        every = torch.empty(local.numel() * group.size, dtype=torch.float64)
        group.all_gather(local, every, kind="control", what="the exact global gradient norm")
        return math.sqrt(math.fsum(every.tolist()))


def grad_norm_for(exact: bool, replicated: bool, group: ProcessGroup) -> GradNorm:
    """``group``: the one the shards are spread over (whose shards cover every element once)."""
    return ExactChunks(group) if exact else SumOfSquares(replicated, group)
