"""ShardedModel: applies a ZeRO stage to a module.

It plans buckets (and, at stage 3, gather units), moves the parameters into flat buffers,
broadcasts rank 0's initial values, builds each bucket's collectives (collectives.py), installs
the gradient hooks and runs the per-backward bookkeeping; stage 3's units are gathered,
prefetched and released by its UnitSchedule (schedule.py). Frozen parameters
(``requires_grad=False``) take no gradient and no optimizer state: at stage 3 they are sharded
in frozen buckets of their unit and gathered with it, in the compute dtype; at stages 0-2 (and
below ``param_persistence_threshold``) they stay ordinary replicated tensors, as buffers always
do (values from rank 0; floating ones in the compute dtype unless ``ShardOptions.buffer_dtype``
is 'model').
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from zerompi.blockio.memory import trim_heap
from zerompi.config.choices import BufferDType, Progress, Rounds
from zerompi.config.sections import OverlapPolicy
from zerompi.errors import UsageError, ZeroMPIError
from zerompi.log import get_logger
from zerompi.offload.tiers import TierPlan
from zerompi.shard.bucket import Bucket, Storage
from zerompi.shard.collectives import BucketCollectives, BucketState
from zerompi.shard.deferred import Materializer, ParamInit
from zerompi.shard.grads import NORM_CHUNK
from zerompi.shard.hooks import HookSet
from zerompi.shard.initial import InitialValues
from zerompi.shard.layout import BucketLayout
from zerompi.shard.placement import ParamPlacement, Residence
from zerompi.shard.planning import log_plan, plan_layouts
from zerompi.shard.prefetch import Prefetcher
from zerompi.shard.schedule import UnitSchedule
from zerompi.shard.steps import Backward, BackwardSteps
from zerompi.shard.units import Unit
from zerompi.shard.wiring import CommFactory
from zerompi.state.declared import Declared, HeldResiduals, StateKind

logger = get_logger(__name__)


@dataclass(frozen=True)
class ShardOptions:
    """How the model is cut into buckets and what runs non-blocking."""

    cap_numel: int
    """Bucket size in elements (stage 3: gather-unit size)."""
    placements: tuple[ParamPlacement, ...]
    """Every parameter's placement (placement.py's ``place``), in ``named_parameters`` order."""
    overlap: OverlapPolicy = OverlapPolicy(False, 0, Progress.NONE)
    """What runs non-blocking (the config's, with the prefetch depth the engine resolved)."""
    param_init: ParamInit | None = None
    """Initialises a meta-device module's own parameters as its bucket is built (deferred.py)."""
    max_live_params: int | None = None
    """Stage 3: prefetch no more than this many elements, the unit computing included."""
    buffer_dtype: BufferDType = BufferDType.COMPUTE
    """'compute': floating buffers are cast to the compute dtype; 'model': each keeps its own."""
    whole_groups: frozenset[int] = frozenset()
    """Optimizer groups whose optimizer sees whole tensors: their buckets are owner-aligned (layout.py)."""


@dataclass(frozen=True)
class _Backward:
    """The backward in progress."""

    sync: bool  # its gradients are reduced (the window ends, or stages 2-3)
    steps: BackwardSteps | None = None  # updates the buckets as their gradients land (the window ends)
    sources: int = 0  # micro_batches: ranks with a micro-batch in this round
    stepped: set[int] = field(default_factory=set)  # id() of the buckets it updated


class ShardedModel:
    """Owns the buckets of ``module`` and the state of the current backward.

    Args:
        module: the model (already on its device).
        storage: stage plan, rank in the shard group, compute dtype and device.
        comm: the process groups (flat, HSDP or hpZ) and what builds each bucket's collectives
            (shard/wiring.py).
        options: bucket size, optimizer groups, overlap, deferred initialisation.
        tiers: where each bucket's shards live between uses (offload/tiers.py).
    """

    def __init__(self, module: nn.Module, storage: Storage, comm: CommFactory, options: ShardOptions,
                 tiers: TierPlan = TierPlan()):
        self.module, self.storage, self.plan, self.tiers = module, storage, storage.plan, tiers
        self.comm, self.groups = comm, comm.groups  # comm builds each bucket's collectives (wiring.py)
        self.materialize = Materializer(module, storage.device, options.param_init,
                                        storage.dtype if self.plan.shard_params else None)
        self.overlap = options.overlap
        self.rounds = comm.rounds  # micro_batches: reduced after each backward, round by round (sync.py)
        self.buffer_dtype = options.buffer_dtype
        self._align = NORM_CHUNK if self.rounds is Rounds.ORDERED else 1  # reproducible: shards of whole norm chunks
        self._whole = options.whole_groups
        self._inflight: list[BucketCollectives] = []  # buckets whose overlapped reduce-scatter is in flight
        self.placements = {pl.fqn: pl for pl in options.placements}
        """Each parameter's placement by fqn, as decided before planning (placement.py), never amended."""
        # requires_grad as planned: a change after initialize would silently train the wrong set
        self._planned = [(n, p, self.placements[n].trainable) for n, p in module.named_parameters()]
        named = [(n, p) for n, p, trains in self._planned if trains]
        uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
        self._tied = {i for i, n in uses.items() if n > 1}  # ids of parameters of several modules
        self.units: list[Unit] = []
        self.initial = InitialValues()  # ranks whose initial values rank 0's replace are named once built
        built = [self._build(layout) for layout in self._plan(options.cap_numel)]
        trim_heap()  # the full tensors each build copied out of, and the shards' unaligned first copies
        # every bucket's collectives (collectives.py), trainable ones first; a frozen bucket is one whose layout
        # does not train: no gradient collective, no optimizer (stage 3 only)
        self.all_collectives = sorted(built, key=lambda c: not c.bucket.trains)
        self.collectives = [c for c in self.all_collectives if c.bucket.trains]
        """The trainable buckets' collectives, indexed by their layout's index (the optimizer's)."""
        self.all_buckets = [c.bucket for c in self.all_collectives]
        self.buckets = [c.bucket for c in self.collectives]
        """The trainable buckets, indexed by their layout's index (the optimizer's and the checkpoint's)."""
        # the checkpoint's number of each frozen bucket (its layout's: they are numbered apart, planning.py)
        self._frozen_at = {c.bucket.layout.index: c for c in self.all_collectives if not c.bucket.trains}
        self._slot_of: dict[nn.Parameter, tuple[BucketCollectives, int]] = {}
        for c in self.collectives:
            for i, p in enumerate(c.bucket.params):
                self._slot_of[p] = (c, i)
        self._sync_replicated()
        self._backward: _Backward | None = None  # set between begin_backward and finish_backward
        self._steps: BackwardSteps | None = None  # optimizer_in_backward (register_backward_steps)
        self.hooks = HookSet()
        self.hooks.on_grad_ready([p for _, p in named], self._on_grad_ready)
        prefetcher = Prefetcher(self.overlap.prefetch_units if self.plan.shard_params else 0,
                                options.max_live_params, lambda u: u.numel)
        self.schedule = UnitSchedule(module, self.units, self.hooks, prefetcher, self.rounds.dealt,
                                     lambda: self.in_backward, self._coming)
        log_plan(self.plan.stage, [(b.layout, b.trains) for b in self.all_buckets], self.storage.world_size)

    @property
    def in_backward(self) -> bool:
        return self._backward is not None

    # ---- planning ---------------------------------------------------------
    def _plan(self, cap: int) -> list[BucketLayout]:
        """Every bucket's layout, in build order (planning.py); stage 3's units; the whole tensors' owners."""
        # the planner's outcomes, beside the placements: stage 3's gather unit of each sharded parameter, and for
        # an optimizer that sees whole tensors (owner-aligned buckets) the rank whose shard holds each tensor
        layouts, self.units, self.unit_of = plan_layouts(self.module, list(self.placements.values()), self.plan,
                                                         self.storage.world_size, cap, self._align, self._whole)
        self.owners: dict[str, int] = {slot.fqn: slot.offset // layout.shard_numel for layout in layouts
                                       if layout.group in self._whole and self.plan.shard_optimizer
                                       for slot in layout.slots}
        self._unit = {u.fqn: u for u in self.units}
        return layouts

    def _build(self, layout: BucketLayout) -> BucketCollectives:
        params = [self.module.get_parameter(slot.fqn) for slot in layout.slots]
        placed = self._bucket_kind(layout)
        frozen = not placed.trainable
        dtype = self.storage.dtype if frozen else torch.float32  # frozen keep just this; trainable: fp32 masters
        init = torch.zeros(layout.padded_numel, dtype=dtype, device=self.storage.device)
        for p, slot in zip(params, layout.slots):
            deferred = p.is_meta
            if deferred:  # deferred initialisation: this bucket's modules become real now
                self.materialize(slot.fqn)
            init[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            if deferred and id(p) not in self._tied:  # in the bucket now: the full tensor may go before
                p.data = p.data.new_empty(0)            # the next one (a tied one is another module's too)
        what = f"initial values of {'frozen ' if frozen else ''}bucket {layout.index}"  # rank 0's, as in DDP
        self.initial.broadcast(init, [(s.fqn, slice(s.offset, s.offset + s.numel)) for s in layout.slots],
                               lambda t: self.groups.world.broadcast(t, what=what))
        storage = dataclasses.replace(self.storage, plan=placed.bucket_plan(self.plan))
        bucket = Bucket(layout, params, storage, init, placed, self.tiers)
        del init  # the next bucket's values may take its place
        comm = self.comm.build(layout, storage.plan, placed, storage.rank, storage.device,
                               bucket.param_full.tensor)
        collectives = BucketCollectives(bucket, comm)
        if bucket.plan.shard_params:
            self._unit[layout.unit].members.append(collectives)
        return collectives

    def _bucket_kind(self, layout: BucketLayout) -> ParamPlacement:
        """The placement every parameter of ``layout`` shares, checked: the bucket is built from one."""
        first, *rest = (self.placements[slot.fqn] for slot in layout.slots)
        odd = next((p for p in rest if p.bucket_kind() != first.bucket_kind()), None)
        if odd is not None:
            raise ZeroMPIError(f"bucket {layout.index} mixes parameters placed differently: {first.fqn}, {odd.fqn}")
        return first

    def replicated_frozen(self) -> list[tuple[str, nn.Parameter]]:
        """The frozen parameters every rank holds whole (all of them at stages 0-2)."""
        return [(n, p) for n, p, _ in self._planned if self.placements[n].residence is Residence.REPLICATED]

    def _sync_replicated(self) -> None:
        """Replicated frozen parameters and buffers: rank 0's values; the parameters in the compute dtype,
        the buffers too unless buffer_dtype is 'model'."""
        frozen, buffers = self.replicated_frozen(), list(self.module.named_buffers())
        cast = {id(t) for _, t in frozen + (buffers if self.buffer_dtype is BufferDType.COMPUTE else [])}
        for name, t in frozen + buffers:
            if t.is_floating_point() and id(t) in cast:
                t.data = t.data.to(self.storage.dtype)
            if not t.is_contiguous():
                t.data = t.data.contiguous()
            self.initial.broadcast(t.data.view(-1), [(name, slice(None))],
                                    lambda v: self.groups.world.broadcast(v, what="a frozen parameter or buffer"))
        self.initial.report(self.groups.world)

    # ---- backward events ---------------------------------------------------
    def _coming(self, units: list[Unit]) -> None:
        """optimizer_in_backward: ``units``' trainable buckets get their gradients next (schedule.py)."""
        if self._backward is not None and self._backward.steps is not None:  # a unit's, then the prefetched
            self._backward.steps.coming([c.bucket for u in units for c in u.members if c.bucket.trains])

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        collectives, slot = self._slot_of[p]
        grad, p.grad = p.grad, None
        if grad is None:
            return
        if self._backward is not None and id(collectives.bucket) in self._backward.stepped:
            raise UsageError(f"parameter {collectives.bucket.layout.slots[slot].fqn!r} received a gradient after its bucket "
                             "was updated in this backward (optimizer_in_backward): reentrant checkpointing of a "
                             "shared parameter? use torch.utils.checkpoint(..., use_reentrant=False), or "
                             "optimizer_in_backward=False")
        if collectives.add_grad(slot, grad) and self._backward is not None and self._backward.sync:
            self._reduce(collectives)
        if self.overlap.progress is Progress.TEST:
            for c in self._inflight:
                c.progress()

    def _reduce(self, collectives: BucketCollectives) -> None:
        overlapped = self.overlap.grad_reduce and not collectives.grad_sync.in_place
        steps = self._backward is not None and self._backward.steps is not None
        collectives.reduce_grads(async_op=overlapped, taken_next=steps)
        if overlapped:
            self._inflight.append(collectives)
        collectives.reshard()
        if steps and not overlapped:
            self._step(collectives.bucket)

    def _step(self, bucket: Bucket) -> None:
        """optimizer_in_backward: ``bucket``'s gradient is final for this window; update it."""
        self._backward.stepped.add(id(bucket))
        self._backward.steps.reduced(bucket)

    def register_backward_steps(self, steps: BackwardSteps) -> None:
        """The optimizer, built after the buckets: a backward that updates (optimizer_in_backward,
        the last of a window) hands ``steps`` each bucket whose gradient is final, in the same order
        on every rank."""
        self._steps = steps

    def begin_backward(self, backward: Backward) -> None:
        """What the engine's iteration machine decided for this backward: whether it ends a
        gradient-accumulation window (stages 0-1 reduce then; stages 2-3 reduce every backward)
        and whether it updates buckets as their gradients become final (register_backward_steps)."""
        if self._backward is not None:
            raise ZeroMPIError("begin_backward() inside a backward: the previous one did not finish")
        if backward.updates and self._steps is None:
            raise ZeroMPIError("a backward that updates buckets, with no optimizer registered to update them")
        self.check_requires_grad()
        self._backward = _Backward(sync=(backward.ends_window or self.plan.shard_grads) and not self.rounds.dealt,
                                   steps=self._steps if backward.updates else None, sources=backward.sources)
        for c in self.collectives:
            c.begin_backward()

    def empty_round(self, sources: int) -> None:
        """micro_batches: a round this rank ran no micro-batch in (its share of the batch is one
        smaller): it still takes its part in the collectives the others' forward and backward run (stage
        3's gathers, the same ones, in the same order, as its own last round: nothing is prefetched in this
        mode) and in every bucket's all-to-all, contributing nothing."""
        self.schedule.replay_last_round()
        for c in self.collectives:
            c.reduce_grads(sources=sources)

    def check_requires_grad(self) -> None:
        """Raise if a parameter's requires_grad changed since initialize: the buckets were planned
        for the old value, so the parameter would silently not train (or train as zeros)."""
        changed = [(n, trains) for n, p, trains in self._planned if p.requires_grad != trains]
        if changed:
            names = ", ".join(f"{n} ({'trainable' if t else 'frozen'} at initialize)" for n, t in changed[:5])
            raise UsageError(f"requires_grad changed after initialize for {len(changed)} parameter(s): {names}; "
                             "set requires_grad before zerompi.initialize, and build a new engine to train "
                             "another set of parameters")

    def abort_backward(self) -> None:
        """Autograd raised: leave the backward (its partial gradients are not reduced)."""
        self._backward = None

    def finish_backward(self) -> None:
        """Reduce what backward left unreduced (unused parameters, late gradients); release all."""
        if self._backward is None:
            raise ZeroMPIError("finish_backward() outside a backward")
        sync, steps = self._backward.sync, self._backward.steps is not None
        for c in self.collectives:
            if sync and c.needs_reduce():
                self._reduce(c)
            elif self.rounds.dealt:  # every rank's gradient of this round
                c.reduce_grads(sources=self._backward.sources)
        if self.rounds.dealt:
            self.schedule.round_done()
        for c in self._inflight:  # in the order they started, as on every rank
            c.finish_reduce(taken_next=steps)
            if steps:
                self._step(c.bucket)
        self._inflight.clear()
        self._backward = None
        for c in self.all_collectives:
            c.reshard()
        if self.plan.shard_params:
            stuck = [c.name for c in self.all_collectives
                     if c.plan.shard_params and c.state is not BucketState.SHARDED]
            if stuck:
                raise ZeroMPIError(f"buckets {stuck} are still gathered after backward")

    # ---- checkpointed state (checkpoint/snapshot.py's StateSource and FrozenHolder) ----
    def declared_state(self) -> tuple[Declared, ...]:
        """Stage 3's frozen shards and this rank's error-feedback residuals."""
        return (Declared(StateKind.FROZEN_SHARDS, self), Declared(StateKind.RESIDUALS, self))

    def residuals(self) -> HeldResiduals:
        """(bucket, this rank's error-feedback residual) of each bucket whose codec keeps one; the live tensors."""
        return tuple((c.bucket.layout.index, c.grad_codes.residual) for c in self.collectives
                     if c.grad_codes is not None and c.grad_codes.residual is not None)

    @contextmanager
    def frozen_shard(self, index: int) -> Iterator[torch.Tensor]:
        with self._frozen_at[index].bucket.param_tier.snapshot() as shard:  # a background save reads it too
            yield shard

    def load_frozen(self, index: int, shard: torch.Tensor) -> None:
        self._frozen_at[index].load_params(shard.to(self.storage.dtype))

    def remove_hooks(self) -> None:
        self.hooks.remove()

    def state_bytes(self) -> int:
        """Model state held in memory: replicated frozen parameters, and every bucket's state."""
        frozen = sum(p.numel() * p.element_size() for _, p in self.replicated_frozen())
        return frozen + sum(c.state_bytes() for c in self.all_collectives)
