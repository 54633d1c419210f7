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

import torch

from zerompi.blockio.aligned import aligned_clone
from zerompi.offload.tiers import Resident, ShardTier, TierPlan
from zerompi.shard.buffer import FlatBuffer
from zerompi.shard.grads import GradShard
from zerompi.shard.layout import BucketLayout
from zerompi.shard.stages import StagePlan
from zerompi.shard.placement import ParamPlacement


@dataclass(frozen=True)
class Storage:
    """How buckets are stored: what the stage shards, this rank, compute dtype, device."""

    plan: StagePlan
    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    check_finite: bool = False  # note which parameters get NaN/Inf gradients, to name them


class Bucket:
    """Flat parameter, master, gradient storage for one :class:`BucketLayout`; what crosses the network
    for it, and when, is its collectives' business (collectives.py), which bind and free its parameters.

    Args:
        layout: the frozen plan of this bucket.
        params: the module parameters of ``layout.slots``, in slot order; they
            are re-bound as views into this bucket's flat parameter buffer.
        storage: stage plan, rank (in ``groups.shard``), dtype and device.
        init: the full padded fp32 initial values (identical on every rank).
        kind: its parameters' placement record (they share one: shard/placement.py): the tier of its
            parameter shard, and whether its weights are quantized (then its master is kept apart).
        tiers: where the shards live between uses (offload/tiers.py).
    """

    def __init__(self, layout: BucketLayout, params: list[torch.nn.Parameter], storage: Storage,
                 init: torch.Tensor, kind: ParamPlacement, tiers: TierPlan = TierPlan()):
        self.layout, self.params, self.storage = layout, params, storage
        plan, dtype, index = storage.plan, storage.dtype, layout.index
        self.plan = plan
        trains = self.trains = layout.trainable
        """It holds trainable parameters: a master, gradients and optimizer state (a frozen bucket holds
        its parameter shard alone)."""
        more = " ..." if len(layout.slots) > 1 else ""
        self.name = f"{'' if trains else 'frozen '}bucket {index} [{layout.slots[0].fqn}{more}]" + \
            (f" of module '{layout.unit or '<root>'}'" if plan.shard_params else "")
        self._sums: list[tuple[str, torch.Tensor]] = []  # check_finite: each gradient's sum since the last step
        # Stage 0 "owns" the whole buffer: every rank updates every element.
        self.own = layout.shard(storage.rank) if plan.shard_optimizer else layout.full
        own = slice(self.own.start, self.own.stop)
        # a master apart from the parameters (frozen buckets have none; stages 1-2 with quantized
        # weights compute with decoded values, so their master is kept apart too)
        self.separate = trains and (dtype != torch.float32 or tiers.moves_state
                                         or (kind.weight_codec is not None and not plan.shard_params))

        if init.dtype == dtype and not trains:  # frozen: the values are all it keeps, in place
            self.param_full = FlatBuffer.holding(init, reuse=tiers.reuse)
        else:
            self.param_full = FlatBuffer(layout.padded_numel, dtype, storage.device, reuse=tiers.reuse)
            self.param_full.tensor.copy_(init)
        if plan.shard_params:
            self.param_tier: ShardTier = tiers.param_tier(index, aligned_clone(self.param_full.tensor[own]),
                                                          kind.tier, frozen=not trains)
        else:
            self.param_tier = Resident(self.param_full.tensor[own])
        if trains:
            self._init_training(init, tiers)
        else:  # frozen: the parameter shard is all there is (no gradient hook ever reaches it)
            self.master = self.grad_full = self.grads = None

        self._views = [self.param_full.view(slot.offset, slot.shape) for slot in layout.slots]
        # Stage 3, between gathers: each parameter keeps its shape over one NaN element (stride 0), so that
        # a read outside a gather gives NaN and a write is refused, where a view of the freed storage would
        # read unmapped memory; autograd's saved views keep the buffer's storage and see it refilled.
        self._holes = self._views
        self._own = {_storage(self.param_full.tensor)}
        if plan.shard_params:
            hole = torch.full((1,), float("nan"), dtype=dtype, device=storage.device)  # compute dtypes float
            self._holes = [hole.expand(slot.shape) for slot in layout.slots]
            self._own.add(_storage(hole))
        for p, view in zip(params, self._views):
            p.data = view
        # Slots whose gradient was written since the buffer was (re)started: the first gradient of
        # a slot is copied in, and what no gradient wrote is zeroed only before a reduction, which
        # saves zeroing the whole buffer first.
        self._written: set[int] = set()

    def _init_training(self, init: torch.Tensor, tiers: TierPlan) -> None:
        """The master, the gradient buffer and the gradient shard of a trainable bucket."""
        plan, storage, index, own = self.plan, self.storage, self.layout.index, self.own
        # The master starts from the fp32 values, not from their rounded copy.
        master = aligned_clone(init[own.start:own.stop]) if self.separate else self.param_tier.tensor
        self.master = tiers.place_master(index, master, self.separate)
        self.grad_full = FlatBuffer(self.layout.padded_numel, storage.dtype, storage.device, zero=True,
                                    allocated=not plan.shard_grads, reuse=tiers.reuse)
        local = self.grad_full.tensor[own.start:own.stop] if not plan.shard_grads else \
            torch.zeros(own.numel, dtype=storage.dtype, device=storage.device)
        self.grads = GradShard(tiers.grad_tier(index, local), own.numel, self.master.device)

    # ---- parameters (bound and freed by the collectives around a gather) ------------------------
    def open_params(self) -> None:
        """Stage 3, before a gather: allocate the full buffer and bind the parameters to its views."""
        self.param_full.alloc()
        self._bind(self._views)

    def close_params(self) -> None:
        """Stage 3, after use: bind the parameters to their NaN stand-ins and release the full buffer
        (autograd's saved views keep its storage)."""
        self._bind(self._holes)
        self.param_full.free()

    def holds(self, t: torch.Tensor) -> bool:
        """``t`` is one of this bucket's parameter bindings (a view of its buffer, or stage 3's NaN stand-in
        between gathers), not a whole copy put in place of one (GatheredParameters' block)."""
        return _storage(t) in self._own

    def _bind(self, tensors: list[torch.Tensor]) -> None:
        """Bind each parameter to its tensor in ``tensors``, except one a caller has put a copy in place of."""
        for p, t in zip(self.params, tensors):
            if _storage(p.data) in self._own:
                p.data = t

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

    def write_grad(self, slot_index: int, grad: torch.Tensor) -> None:
        """Accumulate one parameter's gradient into the full gradient buffer."""
        if not self.grad_full.is_allocated:
            self.grad_full.alloc()
            self._written.clear()
        slot = self.layout.slots[slot_index]
        if self.storage.check_finite:
            self._sums.append((slot.fqn, grad.sum()))  # looked at only if the step's norm is not finite
        dest = self.grad_full.view(slot.offset, slot.shape)
        if slot_index in self._written:
            dest.add_(grad)
        else:
            dest.copy_(grad)
            self._written.add(slot_index)

    def grads_to_reduce(self) -> torch.Tensor:
        """The full gradient buffer, ready to reduce: what no gradient wrote is zeroed (allocated with zeros
        where no gradient reached the bucket)."""
        if not self.grad_full.is_allocated:  # no gradient reached this bucket: it reduces zeros
            self.grad_full.alloc()
            self._written.clear()
        return self._zero_unwritten()

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

    def take_reduced(self, chunks: list[torch.Tensor], each: bool, taken_next: bool) -> None:
        """Add a reduction's ``chunks`` to the gradient shard, in order (``each``: reduced every micro-batch,
        so accumulated, and the full buffer is freed; ``taken_next``: the optimizer updates the bucket right
        after, GradShard.write)."""
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
        """Bytes held persistently in memory: parameters, master (if separate), gradients (what its
        collectives hold, packed codes and hpZ's copy, they count)."""
        params = self.param_tier.nbytes if self.plan.shard_params else self.param_full.nbytes
        if not self.trains:
            return params
        master = self.master.numel() * self.master.element_size() if self.separate else 0
        grads = self.grads.nbytes if self.plan.shard_grads else self.grad_full.nbytes
        return params + master + grads


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself, whichever Python wrapper answers
