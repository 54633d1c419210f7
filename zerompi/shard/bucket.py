"""Bucket: the parameters that are communicated together, and their sharded state.

What a bucket holds persistently depends on the stage (see stages.py's table);
every difference between stages is a field of its :class:`StagePlan`. In fp32
the master *is* the compute-dtype parameter shard (a view of it), so it costs
nothing extra, exactly as the ZeRO paper counts. Transient buffers (stage 3's
gathered parameters, stage 2/3's full gradient bucket during backward) are
allocated only while they are needed. Where the shards live between uses
(device, host, swap file) is the business of the tiers handed in at build.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from zerompi.blockio.aligned import aligned_clone
from zerompi.comm.group import Work
from zerompi.errors import UsageError, ZeroMPIError
from zerompi.offload.tiers import Resident, ShardTier, TierPlan
from zerompi.shard.buffer import FlatBuffer
from zerompi.shard.grads import GradShard
from zerompi.shard.layout import BucketLayout
from zerompi.shard.stages import StagePlan
from zerompi.shard.sync import GradSync, ParamSync
from zerompi.shard.placement import ParamPlacement
from zerompi.shard.wiring import CommFactory


class BucketState(Enum):
    """Where the bucket's parameters are. Stages 0-2 are always GATHERED."""

    SHARDED = "sharded"      # stage 3: only this rank's shard exists
    GATHERING = "gathering"  # stage 3: a non-blocking all-gather into the full buffer is in flight
    GATHERED = "gathered"    # the full parameters are in ``param_full``


@dataclass(frozen=True)
class Placement:
    """How buckets are stored: what the stage shards, this rank, compute dtype, device."""

    plan: StagePlan
    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    check_finite: bool = False  # note which parameters get NaN/Inf gradients, to name them


class Bucket:
    """Flat parameter, master, gradient storage for one :class:`BucketLayout`.

    Args:
        layout: the frozen plan of this bucket.
        params: the module parameters of ``layout.slots``, in slot order; they
            are re-bound as views into this bucket's flat parameter buffer.
        placement: stage plan, rank (in ``groups.shard``), dtype and device.
        init: the full padded fp32 initial values (identical on every rank).
        comm: builds the bucket's collectives (shard/wiring.py), once, from its layout and plan.
        kind: its parameters' placement record (they share one: shard/placement.py): the tier of its
            parameter shard and the codecs of its collectives.
        tiers: where the shards live between uses (offload/tiers.py).
    """

    def __init__(self, layout: BucketLayout, params: list[torch.nn.Parameter], placement: Placement,
                 init: torch.Tensor, comm: CommFactory, kind: ParamPlacement, tiers: TierPlan = TierPlan()):
        self.layout, self.params, self.placement = layout, params, placement
        plan, dtype, index = placement.plan, placement.dtype, layout.index
        self.plan = plan
        trains = self.trains = layout.trainable
        """It holds trainable parameters: a master, gradients and optimizer state (a frozen bucket holds
        its parameter shard alone)."""
        more = " ..." if len(layout.slots) > 1 else ""
        self.name = f"{'' if trains else 'frozen '}bucket {index} [{layout.slots[0].fqn}{more}]" + \
            (f" of module '{layout.unit or '<root>'}'" if plan.shard_params else "")
        self._sums: list[tuple[str, torch.Tensor]] = []  # check_finite: each gradient's sum since the last step
        self._gather: Work | None = None   # a non-blocking all-gather in flight (GATHERING)
        self._reduce: Work | None = None   # an overlapped reduce-scatter in flight
        # Stage 0 "owns" the whole buffer: every rank updates every element.
        self.own = layout.shard(placement.rank) if plan.shard_optimizer else layout.full
        own = slice(self.own.start, self.own.stop)
        # a master apart from the parameters (frozen buckets have none; stages 1-2 with quantized
        # weights compute with decoded values, so their master is kept apart too)
        self.separate = trains and (dtype != torch.float32 or tiers.moves_state
                                         or (kind.weight_codec is not None and not plan.shard_params))

        if init.dtype == dtype and not trains:  # frozen: the values are all it keeps, in place
            self.param_full = FlatBuffer.holding(init, reuse=tiers.reuse)
        else:
            self.param_full = FlatBuffer(layout.padded_numel, dtype, placement.device, reuse=tiers.reuse)
            self.param_full.tensor.copy_(init)
        if plan.shard_params:
            self.param_tier: ShardTier = tiers.param_tier(index, aligned_clone(self.param_full.tensor[own]),
                                                          kind.tier, frozen=not trains)
        else:
            self.param_tier = Resident(self.param_full.tensor[own])
        self.comm = comm.build(layout, plan, kind, placement.rank, placement.device, self.param_full.tensor)
        """Its collectives, built apart from its storage (shard/wiring.py)."""
        self.param_sync: ParamSync = self.comm.param
        self.grad_sync: GradSync | None = self.comm.grad  # None for a frozen bucket
        self.weight_codes, self.grad_codes, self.secondary = \
            self.comm.weight_codes, self.comm.grad_codes, self.comm.secondary
        if trains:
            self._init_training(init, tiers)
        else:  # frozen: the parameter shard is all there is (no gradient hook ever reaches it)
            self.master = self.grad_full = self.grads = None
        if self.weight_codes is not None and not plan.shard_params:  # stages 1-2 compute with decoded values
            self.weight_codes.decode_all(self.param_full.tensor)

        self._views = [self.param_full.view(slot.offset, slot.shape) for slot in layout.slots]
        # Stage 3, between gathers: each parameter keeps its shape over one NaN element (stride 0), so that
        # a read outside a gather gives NaN and a write is refused, where a view of the freed storage would
        # read unmapped memory; autograd's saved views keep the buffer's storage and see it refilled.
        self._holes = self._views
        self._own = {_storage(self.param_full.tensor)}
        if plan.shard_params:
            hole = torch.full((1,), float("nan"), dtype=dtype, device=placement.device)  # compute dtypes float
            self._holes = [hole.expand(slot.shape) for slot in layout.slots]
            self._own.add(_storage(hole))
        for p, view in zip(params, self._views):
            p.data = view
        self.state = BucketState.GATHERED
        if plan.shard_params:
            self.reshard()
        self._ready: set[int] = set()
        # Slots whose gradient was written since the buffer was (re)started: the first gradient of
        # a slot is copied in, and what no gradient wrote is zeroed only before a reduction, which
        # saves zeroing the whole buffer first.
        self._written: set[int] = set()
        self._pending = False   # gradients added since the last reduction
        self._reduced = False   # reduced at least once in this backward

    def _init_training(self, init: torch.Tensor, tiers: TierPlan) -> None:
        """The master, the gradient buffer and the gradient shard of a trainable bucket."""
        plan, placement, index, own = self.plan, self.placement, self.layout.index, self.own
        # The master starts from the fp32 values, not from their rounded copy.
        master = aligned_clone(init[own.start:own.stop]) if self.separate else self.param_tier.tensor
        self.master = tiers.place_master(index, master, self.separate)
        self.grad_full = FlatBuffer(self.layout.padded_numel, placement.dtype, placement.device, zero=True,
                                    allocated=not plan.shard_grads, reuse=tiers.reuse)
        local = self.grad_full.tensor[own.start:own.stop] if not plan.shard_grads else \
            torch.zeros(own.numel, dtype=placement.dtype, device=placement.device)
        self.grads = GradShard(tiers.grad_tier(index, local), own.numel, self.master.device)

    def _illegal(self, verb: str, allowed: str) -> ZeroMPIError:
        return ZeroMPIError(f"{self.name}: {verb} in state {self.state.name} (allowed from {allowed})")

    # ---- parameters -------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> Work:
        """Stage 3: SHARDED -> GATHERED (blocking) or GATHERING (``async_op``). A bucket already
        gathered or gathering has nothing to start: its in-flight gather, if any, is returned."""
        if self.state is not BucketState.SHARDED:
            return self._gather if self._gather is not None else Work.done()
        self.param_full.alloc()
        self._bind(self._views)
        source = self.param_sync.source(self.param_tier)
        async_op = async_op and (source is None or source.stays_resident)  # a swapped shard is gone after its block
        work = self.param_sync.gather(self.param_tier, self.param_full.tensor, async_op=async_op, what=self.name)
        if async_op:
            self._gather, self.state = work, BucketState.GATHERING
        else:
            self.state = BucketState.GATHERED
        return work

    def prefetch(self) -> None:
        """Start what ``unshard()`` will wait on: a non-blocking all-gather, or, for a shard in the
        swap file, its read (the gather then runs when the unit needs it)."""
        source = self.param_sync.source(self.param_tier)
        if source is None or source.stays_resident:
            self.unshard(async_op=True)
        elif self.state is BucketState.SHARDED:
            source.prefetch()

    def wait_gathered(self) -> None:
        """GATHERING -> GATHERED: block until the all-gather has landed (GATHERED: nothing to do)."""
        if self.state is BucketState.SHARDED:
            raise self._illegal("wait_gathered()", "GATHERING or GATHERED: no gather was started")
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        self.state = BucketState.GATHERED

    def progress(self) -> None:
        """Let MPI move this bucket's non-blocking collectives along (MPI_Test)."""
        for work in (self._gather, self._reduce):
            if work is not None:
                work.test()

    def reshard(self) -> None:
        """Stage 3: GATHERING/GATHERED -> SHARDED, freeing the gathered parameters (the parameters
        bound to their NaN stand-ins, the storage released, autograd's saved views kept; an in-flight
        gather is waited for first, since MPI may still be writing). Idempotent; stages 0-2 keep their
        parameters whole."""
        if not self.plan.shard_params or self.state is BucketState.SHARDED:
            return
        self.wait_gathered()
        self._bind(self._holes)
        self.param_full.free()
        self.state = BucketState.SHARDED

    def holds(self, t: torch.Tensor) -> bool:
        """``t`` is one of this bucket's parameter bindings (a view of its buffer, or stage 3's NaN stand-in
        between gathers), not a whole copy put in place of one (GatheredParameters' block)."""
        return _storage(t) in self._own

    def _bind(self, tensors: list[torch.Tensor]) -> None:
        """Bind each parameter to its tensor in ``tensors``, except one a caller has put a copy in place of."""
        for p, t in zip(self.params, tensors):
            if _storage(p.data) in self._own:
                p.data = t

    def publish(self) -> None:
        """After an optimizer step: bring the updated master into the compute parameters."""
        if self.plan.shard_params and self.state is not BucketState.SHARDED:
            raise self._illegal("publish()", "SHARDED: the step runs between backward and forward")
        if self.param_tier.reads_master and not self.param_sync.publishes:
            return  # the next gather reads the master's region, which the step writes
        with self.param_tier.loaded(load=False) as shard:
            if self.separate:
                shard.copy_(self.master)
            self.param_sync.publish(shard, self.param_full.tensor, self.name)
            self.param_tier.store()

    # ---- gradients --------------------------------------------------------
    @property
    def nonfinite(self) -> list[str]:
        """Parameters whose local gradient had a NaN/Inf since the last step (or values whose sum
        overflows, whose squares then overflow the norm too). The sums wait on the device until asked:
        reading each in backward stalled a GPU's queue once per parameter
        (benchmarks/results/gpu-h200-np1-profile.txt)."""
        if not self._sums:
            return []
        finite = torch.isfinite(torch.stack([s.float() for _, s in self._sums])).tolist()
        return [fqn for (fqn, _), ok in zip(self._sums, finite) if not ok]

    def forget_nonfinite(self) -> None:
        self._sums.clear()

    def begin_backward(self) -> None:
        self._ready.clear()
        self._reduced = False

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> bool:
        """Accumulate one parameter's gradient; True once every slot has reported."""
        self.finish_reduce()  # a late gradient must not race an overlapped reduce-scatter of the buffer
        if self._reduced and not self.plan.shard_grads:
            raise UsageError(
                f"parameter {self.layout.slots[slot_index].fqn!r} received a second gradient after its "
                "bucket was reduced in this backward (reentrant checkpointing of a shared parameter?); "
                "use torch.utils.checkpoint(..., use_reentrant=False) or ZeRO stage 2/3")
        if not self.grad_full.is_allocated:
            self.grad_full.alloc()
            self._written.clear()
        slot = self.layout.slots[slot_index]
        if self.placement.check_finite:
            self._sums.append((slot.fqn, grad.sum()))  # looked at only if the step's norm is not finite
        dest = self.grad_full.view(slot.offset, slot.shape)
        if slot_index in self._written:
            dest.add_(grad)
        else:
            dest.copy_(grad)
            self._written.add(slot_index)
        self._ready.add(slot_index)
        self._pending = True
        return len(self._ready) == len(self.layout.slots)

    def needs_reduce(self) -> bool:
        """Every bucket is reduced once per synchronising backward, and again for late gradients."""
        return self._pending or not self._reduced

    def reduce_grads(self, *, async_op: bool = False, taken_next: bool = False, sources: int | None = None) -> None:
        """Average this bucket's gradients over all ranks into the shard this rank owns.

        ``async_op`` (stages 1-3) only starts the reduce-scatter; ``finish_reduce`` applies it.
        ``taken_next``: the optimizer updates this bucket right after (GradShard.write).
        ``sources`` (micro_batches): a round, after each backward and for each round this rank ran no
        micro-batch in (nothing written), in which the first ``sources`` ranks ran one: its gradients are
        added to the shard (SummedRounds; reproducible=True: in rank order, OrderedRounds).
        """
        if not self.grad_full.is_allocated:  # no gradient reached this bucket: it reduces zeros
            self.grad_full.alloc()
            self._written.clear()
        full = self._zero_unwritten()
        self._pending = False
        self._reduced = True
        work = self.grad_sync.start(full, async_op=async_op, what=self.name, sources=sources)
        if self.grad_sync.in_place:
            self.grads.filled_in_place()  # the shard is the whole buffer, reduced in place
            return
        self._reduce = work
        if not async_op:
            self.finish_reduce(taken_next=taken_next)

    def _zero_unwritten(self) -> torch.Tensor:
        """Zero what no gradient wrote (padding, parameters without a gradient); the full buffer."""
        full, end = self.grad_full.tensor, 0
        for slot_index, slot in enumerate(self.layout.slots):  # in offset order
            if slot_index in self._written:
                full[end:slot.offset].zero_()
                end = slot.offset + slot.numel
        full[end:].zero_()
        self._written = set(range(len(self.layout.slots)))
        return full

    def finish_reduce(self, *, taken_next: bool = False) -> None:
        """Apply a started reduce-scatter: into the gradient shard, divided by the world size
        (``taken_next``: see reduce_grads)."""
        if self._reduce is None:
            return
        work, self._reduce = self._reduce, None
        # stage 1 reduced the window's local sum once; stages 2-3 add each micro-batch
        each = self.grad_sync.per_micro_batch
        chunks = self.grad_sync.finish(work, self.name)
        for i, chunk in enumerate(chunks):  # a round's in rank order, each added on its own
            self.grads.write(chunk, accumulate=each or i > 0, taken_next=taken_next and i == len(chunks) - 1)
        if each:
            self.grad_full.free()

    def master_grad(self) -> torch.Tensor:
        """This rank's reduced gradient in fp32, where the master lives (zeros before any reduction)."""
        return self.grads.peek()

    def zero_grad(self) -> None:
        """After a step: the next reduction starts the gradient afresh."""
        if not self.plan.shard_grads:
            self._written.clear()  # the next gradients overwrite; the rest is zeroed before reducing
        self.grads.zero()

    # ---- state ------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes held persistently in memory: parameters, master (if separate), gradients."""
        params = self.param_tier.nbytes if self.plan.shard_params else self.param_full.nbytes
        if self.secondary is not None:
            params += self.secondary.nbytes
        if not self.trains:
            return params
        master = self.master.numel() * self.master.element_size() if self.separate else 0
        grads = self.grads.nbytes if self.plan.shard_grads else self.grad_full.nbytes
        codes = sum(c.nbytes for c in (self.weight_codes, self.grad_codes) if c is not None)
        return params + master + grads + codes

    def full_master(self) -> torch.Tensor:
        """Collective: the full padded fp32 master of this bucket, on every rank (a frozen bucket's
        parameters, widened to fp32)."""
        if not self.trains:
            return self.full_params().float()
        if not self.plan.shard_optimizer:
            return self.master.detach().clone()
        out = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.master.device)
        self.comm.shard.all_gather(self.master.contiguous(), out, kind="state_dict", what=self.name)
        return out

    def full_params(self) -> torch.Tensor:
        """Collective (stage 3): the full padded compute-dtype parameters, gathered from the shards
        into a new tensor (the bucket stays SHARDED)."""
        out = torch.empty(self.layout.padded_numel, dtype=self.placement.dtype, device=self.placement.device)
        with self.param_tier.loaded() as shard:
            self.comm.shard.all_gather(shard, out, kind="state_dict", what=self.name)
        return out

    def load_params(self, shard: torch.Tensor) -> None:
        """Overwrite a frozen bucket's parameter shard (a checkpoint load); collective under hpZ,
        whose node-local copy is rebuilt from the new shards."""
        if self.trains or self.state is not BucketState.SHARDED:
            raise self._illegal("load_params()", "SHARDED, on a frozen bucket")
        with self.param_tier.loaded(load=False) as mine:
            mine.copy_(shard)  # then to where gathers read: the packed shard, hpZ's node copy
            self.param_sync.publish(mine, self.param_full.tensor, self.name)
            self.param_tier.store()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself, whichever Python wrapper answers
