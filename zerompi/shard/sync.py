"""A bucket's collectives, apart from its storage: one parameter and one gradient strategy per bucket.

A :class:`~zerompi.shard.bucket.Bucket` owns buffers and tiers; the strategies
chosen here, once per bucket from its stage-table row, own what crosses the
network (Megatron-Core keeps ``_ParamAndGradBuffer`` apart from its bucket
groups in the same way). They hold groups and codes, never the bucket's
tensors: the bucket's collectives (collectives.py) hand in the buffer of the
moment, since a gathered buffer is freed and reallocated.

Parameters (:class:`ParamSync`):
  - ``Whole``: stage 0, every rank updates every element; nothing is sent.
  - ``GatherAfterStep``: stages 1-2, the updated shards are all-gathered after the step.
  - ``GatherForUse``: stage 3 (and frozen shards), gathered around forward and backward.
  - wrappers: ``NodeCopy`` (hpZ: gathers read a node-local copy, refreshed once per step)
    and ``QuantizedWeights`` (packed codes gathered and decoded; shard/compression.py).
Gradients (:class:`GradSync`):
  - ``AllReduce``: stage 0, a reduce-scatter and an all-gather, so replicas stay bitwise equal.
  - ``ReduceScatter``: stages 1-3 (stage 1 once per window, stages 2-3 every micro-batch), over
    quantized codes when the bucket has them, then across nodes under HSDP.
  - ``SummedRounds`` / ``OrderedRounds``: a global batch dealt in ``micro_batches``, reduced round by
    round (reproducible=True: each micro-batch added in global index order).
"""
from __future__ import annotations

from typing import Protocol

import torch

from zerompi.comm.group import ProcessGroup, Work
from zerompi.config.choices import Rounds
from zerompi.errors import ZeroMPIError
from zerompi.offload.tiers import Resident, ShardTier
from zerompi.shard.compression import GradCodes, WeightCodes
from zerompi.shard.layout import BucketLayout
from zerompi.shard.stages import StagePlan

Used = tuple[int, ...] | None  # an owner-aligned bucket's live elements per rank (BucketLayout.used)


class ParamSync(Protocol):
    """How a bucket's parameters travel."""

    publishes: bool
    """``publish`` communicates (else a step that wrote the master's region in place is all)."""

    def source(self, shard: ShardTier) -> ShardTier | None:
        """What a gather reads (None: packed codes held in memory)."""

    def gather(self, shard: ShardTier, out: torch.Tensor, *, async_op: bool, what: str) -> Work:
        """Stage 3: the full parameters into ``out`` from every rank's ``shard``."""

    def publish(self, shard: torch.Tensor, full: torch.Tensor, what: str) -> None:
        """After a step (or a load of frozen values): bring the new ``shard`` to where gathers and
        the compute parameters ``full`` read."""


class Whole:
    """Stage 0: every rank holds and updates the whole bucket."""

    publishes = False

    def source(self, shard: ShardTier) -> ShardTier | None:
        return shard

    def gather(self, shard: ShardTier, out: torch.Tensor, *, async_op: bool, what: str) -> Work:
        raise AssertionError(f"{what}: parameters kept whole are never gathered")

    def publish(self, shard: torch.Tensor, full: torch.Tensor, what: str) -> None:
        pass


class GatherAfterStep(Whole):
    """Stages 1-2: parameters stay whole; each rank's updated shard is all-gathered after the step
    (``used``: an owner-aligned bucket's live elements per rank, all that travels)."""

    publishes = True

    def __init__(self, group: ProcessGroup, used: Used = None):
        self.group, self.used = group, used

    def publish(self, shard: torch.Tensor, full: torch.Tensor, what: str) -> None:
        self.group.all_gather(None, full, what=what, used=self.used)  # the shard is a view of ``full``: in place


class GatherForUse(Whole):
    """Stage 3: only the shard persists; the unit's forward and backward gather it."""

    def __init__(self, group: ProcessGroup, used: Used = None):
        self.group, self.used = group, used

    def gather(self, shard: ShardTier, out: torch.Tensor, *, async_op: bool, what: str) -> Work:
        async_op = async_op and shard.stays_resident  # a swapped shard is gone after its block
        with shard.loaded() as tensor:
            return self.group.all_gather(tensor, out, async_op=async_op, what=what, used=self.used)


class NodeCopy(Whole):
    """hpZ: gathers read this node's copy of the parameters (sharded inside the node), which the
    one cross-node all-gather of parameters per step refreshes."""

    publishes = True

    def __init__(self, inner: GatherForUse, group: ProcessGroup, copy: Resident):
        self.inner, self.group, self.copy = inner, group, copy

    def source(self, shard: ShardTier) -> ShardTier | None:
        return self.copy

    def gather(self, shard: ShardTier, out: torch.Tensor, *, async_op: bool, what: str) -> Work:
        return self.inner.gather(self.copy, out, async_op=async_op, what=what)

    def publish(self, shard: torch.Tensor, full: torch.Tensor, what: str) -> None:
        self.inner.publish(shard, full, what)
        self.group.all_gather(shard, self.copy.tensor, what=what)


class QuantizedWeights(Whole):
    """Parameters cross as packed codes (and hpZ's node copy is held packed: WeightCodes)."""

    publishes = True

    def __init__(self, codes: WeightCodes, after_step: bool):
        self.codes, self.after_step = codes, after_step

    def source(self, shard: ShardTier) -> ShardTier | None:
        return None  # the packed shard, encoded once per step, stays in memory

    def gather(self, shard: ShardTier, out: torch.Tensor, *, async_op: bool, what: str) -> Work:
        return self.codes.gather(out, async_op=async_op, what=what)

    def publish(self, shard: torch.Tensor, full: torch.Tensor, what: str) -> None:
        self.codes.publish(shard, full if self.after_step else None, what)


def param_sync_for(plan: StagePlan, groups, layout: BucketLayout, codes: WeightCodes | None,
                   node_copy: Resident | None) -> ParamSync:
    """The parameter strategy of a bucket running ``plan`` (``codes``: quantized weights;
    ``node_copy``: hpZ's secondary copy). Quantized codes and hpZ's node copy carry an
    owner-aligned bucket's padding too; plain gathers carry its live elements only."""
    if codes is not None:
        return QuantizedWeights(codes, plan.gather_after_step)
    if plan.shard_params:
        if node_copy is not None:
            return NodeCopy(GatherForUse(groups.gather), groups.secondary, node_copy)
        return GatherForUse(groups.gather, layout.used)
    return GatherAfterStep(groups.shard, layout.used) if plan.gather_after_step else Whole()


class GradSync(Protocol):
    """How a bucket's gradients are averaged into the shard its rank owns.

    With ``micro_batches`` the reductions are a schedule of rounds (sync.py's OrderedRounds and
    SummedRounds): after each backward, ``start`` is told how many ranks ran a micro-batch in the
    round (``sources``), through the same verbs."""

    in_place: bool
    """The reduction completes in the full buffer itself (``start`` returns None)."""
    per_micro_batch: bool
    """Reduced after every micro-batch and summed into the shard (the full buffer is freed after)."""

    def start(self, full: torch.Tensor, *, async_op: bool, what: str, sources: int | None = None) -> Work | None: ...

    def finish(self, work: Work, what: str) -> list[torch.Tensor]:
        """What to add to this rank's shard, in order (one averaged chunk, or a round's chunks)."""


class AllReduce:
    """Stage 0: reduce-scatter + all-gather = all-reduce, with bitwise identical replicas."""

    in_place, per_micro_batch = True, False

    def __init__(self, group: ProcessGroup, layout: BucketLayout, world_size: int):
        self.group, self.layout, self.world_size = group, layout, world_size

    def start(self, full: torch.Tensor, *, async_op: bool, what: str, sources: int | None = None) -> Work | None:
        mine, used = self.layout.shard(self.group.rank), self.layout.used
        reduced = self.group.reduce_scatter(full, kind="all_reduce", what=what, used=used).wait()
        full[mine.start:mine.stop].copy_(reduced.div_(self.world_size))
        self.group.all_gather(None, full, kind="all_reduce", what=what, used=used)
        return None

    def finish(self, work: Work, what: str) -> list[torch.Tensor]:
        raise AssertionError(f"{what}: an all-reduce completes in start()")


class ReduceScatter:
    """Stages 1-3: each rank receives the sum of its chunk (over ``codes`` when quantized), summed
    across nodes under HSDP (``replicate``), then divided by the world size."""

    in_place = False

    def __init__(self, group: ProcessGroup, world_size: int, per_micro_batch: bool,
                 codes: GradCodes | None = None, replicate: ProcessGroup | None = None, used: Used = None):
        self.group, self.world_size, self.per_micro_batch = group, world_size, per_micro_batch
        self.codes, self.replicate, self.used = codes, replicate, used

    def start(self, full: torch.Tensor, *, async_op: bool, what: str, sources: int | None = None) -> Work | None:
        if self.codes is not None:  # quantized chunks carry the padding of an owner-aligned bucket too
            return self.codes.reduce_scatter(full, what=what, async_op=async_op)
        return self.group.reduce_scatter(full, what=what, async_op=async_op, used=self.used)

    def finish(self, work: Work, what: str) -> list[torch.Tensor]:
        reduced = work.wait()
        if self.replicate is not None:  # hsdp: sum the node's shard across nodes, in fp32
            self.replicate.all_reduce(reduced, what=what)
        return [reduced.div_(self.world_size)]


class OrderedRounds:
    """reproducible=True: every micro-batch's gradient reaches the shard owners whole, and each owner
    adds them in the order of their global micro-batch index, whatever rank ran them.

    Ranks run micro-batches round robin (rank r: r, r+N, r+2N, ...), so round k brings indices kN..kN+N-1,
    one per rank in rank order: an all-to-all hands owner s chunk s of every rank's gradient, in rank
    order, and the owner adds the first ``sources`` of them (the ranks that had a micro-batch in this
    round) to its shard. That is the sequential sum one process accumulating every micro-batch
    computes, element by element, at any world size. It moves what one reduce-scatter moves."""

    in_place, per_micro_batch = False, True

    def __init__(self, group: ProcessGroup, layout: BucketLayout):
        self.group, self.chunk, self.used = group, layout.shard_numel, layout.used

    def start(self, full: torch.Tensor, *, async_op: bool, what: str, sources: int | None = None) -> Work | None:
        """The round: this rank's chunk of the first ``sources`` ranks' ``full``, in rank order."""
        if sources is None:
            raise ZeroMPIError(f"{what}: ordered rounds reduce once per round, given its sources")
        recv = torch.empty_like(full)
        self.group.all_to_all(full, recv, kind="reduce_scatter", what=what, used=self.used)
        return Work.done([recv[r * self.chunk:(r + 1) * self.chunk] for r in range(sources)])

    def finish(self, work: Work, what: str) -> list[torch.Tensor]:
        return work.wait()


class SummedRounds:
    """micro_batches without reproducible=True: each round's gradients (zeros from a rank that ran no
    micro-batch in it) are reduce-scattered, and the owner adds the sum to its shard. The micro-batches
    are the same at any world size; the order their gradients are summed in is MPI's and the rounds'."""

    in_place, per_micro_batch = False, True

    def __init__(self, group: ProcessGroup, replicate: ProcessGroup | None = None, used: Used = None):
        self.group, self.replicate, self.used = group, replicate, used

    def start(self, full: torch.Tensor, *, async_op: bool, what: str, sources: int | None = None) -> Work | None:
        """The round: this rank's chunk of its sum (each loss already scaled by 1/micro_batches), summed
        across nodes under HSDP."""
        if sources is None:
            raise ZeroMPIError(f"{what}: rounds reduce once per round, given its sources")
        reduced = self.group.reduce_scatter(full, what=what, used=self.used).wait()
        if self.replicate is not None:
            self.replicate.all_reduce(reduced, what=what)
        return Work.done([reduced])

    def finish(self, work: Work, what: str) -> list[torch.Tensor]:
        return work.wait()


def grad_sync_for(plan: StagePlan, groups, layout: BucketLayout, codes: GradCodes | None, *,
                  rounds: Rounds = Rounds.WINDOW) -> GradSync:
    """The gradient strategy of a trainable bucket running ``plan`` (``rounds``: the config's)."""
    if rounds is Rounds.ORDERED:
        return OrderedRounds(groups.shard, layout)
    if rounds is Rounds.SUMMED:
        return SummedRounds(groups.shard, groups.replicate, layout.used)
    if plan.all_reduce_grads:
        return AllReduce(groups.shard, layout, groups.world.size)
    return ReduceScatter(groups.shard, groups.world.size, plan.shard_grads, codes, groups.replicate, layout.used)
