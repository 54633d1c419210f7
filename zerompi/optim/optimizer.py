"""ZeroOptimizer: any element-wise ``torch.optim`` optimizer on this rank's fp32 shards.

The inner optimizer sees one flat fp32 tensor per bucket (the master shard)
instead of the model's parameters. Element-wise optimizers (Adam, AdamW,
SGD, Adagrad, ...) compute the same update on a flat shard as on the
parameters it came from; optimizers that look at whole tensors (LAMB's
trust ratio, Shampoo) would not, and are not supported.

``step()`` reads as its phases: one all-reduce of the unscaled squared
gradient norms (which also detects fp16 overflow), clip, update and publish.
The gradients come from each bucket's :class:`GradShard` and the state from
the store the offload tiers chose, so there is one step whatever is offloaded.
With ``optimizer_in_backward`` the update and publish of each bucket run
earlier, when the sharded model hands it over during backward (``coming`` and
``reduced``, shard/steps.py); ``step()`` then all-reduces the norms recorded
there and updates only what backward did not reach.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from zerompi.blockio.aligned import align_storage
from zerompi.blockio.memory import trim_heap
from zerompi.comm.group import ProcessGroup
from zerompi.config.checks import FIELD_ARGS
from zerompi.config.choices import NonFinite
from zerompi.config.sections import OptimizerPolicy, PrecisionPolicy
from zerompi.errors import ZeroMPIError
from zerompi.log import get_logger
from zerompi.offload.residency import ShardState
from zerompi.offload.tiers import TierPlan
from zerompi.optim import groups as group_optimizers
from zerompi.optim.groups import KERNEL_KEYS, changed_on_resume
from zerompi.optim.norms import grad_norm_for
from zerompi.optim.precision import LossScaler
from zerompi.shard.bucket import Bucket
from zerompi.shard.collectives import BucketCollectives
from zerompi.state.declared import Declared, StateKind

logger = get_logger(__name__)


class StepResult(NamedTuple):
    stepped: bool
    grad_norm: float | None




def default_kernel(cls: type, device: torch.device | str) -> dict[str, Any]:
    """torch's fastest kernel for Adam/AdamW state on the CPU: ``fused`` (one vectorised pass per
    flat shard; 6.8x the for-loop at 120M parameters, benchmarks/results/offload.md), else
    ``foreach`` where this torch's class lacks fused. Nothing for other optimizers, or when the
    state is on an accelerator (torch picks foreach there by itself)."""
    if torch.device(device).type != "cpu" or cls not in (torch.optim.Adam, torch.optim.AdamW):
        return {}
    accepted = inspect.signature(cls).parameters
    return {"fused": True} if "fused" in accepted else {"foreach": True} if "foreach" in accepted else {}


def optimizer_kwargs(policy: OptimizerPolicy, device: torch.device | str) -> dict[str, Any]:
    """Constructor arguments for the configured optimizer (``cfg.optimization``) whose state lives on
    ``device``.

    The one place the default kernel is chosen: the engine and the parity tests' single-process
    reference both build their optimizer from this, so they run the same arithmetic."""
    name = policy.optimizer if isinstance(policy.optimizer, str) else ""
    base = {k: getattr(policy, k) for k in FIELD_ARGS.get(name, ("lr",))}
    if "betas" in base:
        base["betas"] = tuple(base["betas"])
    if policy.deterministic:  # the for-loop kernel (config/reproducible.py refused fused and foreach)
        if "foreach" in inspect.signature(policy.optimizer_class()).parameters:
            base["foreach"] = False
    elif not any(k in policy.kwargs for k in KERNEL_KEYS):
        base.update(default_kernel(policy.optimizer_class(), device))
    return {**base, **policy.kwargs}


class ZeroOptimizer(torch.optim.Optimizer):
    """Runs the configured optimizer over the buckets' master shards.

    To schedulers and to user code it is a ``torch.optim.Optimizer`` whose
    ``param_groups`` are the user's groups (one, or the ``param_groups`` given to
    ``initialize``, in that order): they are the inner optimizer's group dicts
    themselves, so setting ``param_groups[i]["lr"]`` (or any option) reaches every
    bucket shard of group i. Its ``state`` is the inner optimizer's, keyed by shard.

    Args:
        collectives: every trainable bucket's collectives (shard/collectives.py), by bucket index: the
            buckets' storage is what the optimizer updates; their collectives publish the update, hold the
            quantized gradients' residuals, and their shard group adds up the norm.
        policy: the optimizer, its hyperparameters, clipping, non-finite handling (cfg.optimization).
        precision: the compute dtype and fp16 loss scaling (cfg.precision).
        group: the group whose shards cover every element once (for the norm all-reduce).
        specs: each optimizer param group's optimizer and options, checked (optim/groups.py's
            ``group_optimizers``, which the engine runs before anything is built).
        tiers: where master and optimizer state live (their store streams them for the step, and
            hands out a bucket an asynchronous save still reads only once the save has it).
    """

    def __init__(self, collectives: list[BucketCollectives], policy: OptimizerPolicy, precision: PrecisionPolicy,
                 group: ProcessGroup,
                 specs: list[group_optimizers.GroupOptimizer], tiers: TierPlan = TierPlan()):
        self.collectives = collectives
        self.buckets = buckets = [c.bucket for c in collectives]
        self.group = group
        self.clip = policy.clip_grad_norm
        self.nonfinite = policy.nonfinite
        self.norm = grad_norm_for(exact=policy.deterministic,
                                  replicated=not any(b.plan.shard_optimizer for b in buckets),
                                  group=collectives[0].shard_group)
        self.scaler = LossScaler.from_policy(precision) if precision.scales_loss else None
        # the kernel follows where the masters live: host memory (CPU device or 'cpu'/'nvme' offload)
        device = buckets[0].master.device
        self.inner, self.group_names, self.views = group_optimizers.build(specs, buckets, policy,
                                                                          lambda p: optimizer_kwargs(p, device))
        """The inner torch optimizers (one state), each kept param group's optimizer class, and the tensor
        views a whole-tensor group steps instead of its buckets' flat masters (whole.py)."""
        self.store = tiers.optimizer_store(buckets, self.inner)
        # torch.optim.Optimizer's bookkeeping over the inner optimizer's own group dicts (shared,
        # not copied) and state, so that schedulers and hooks see and change the real thing
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.state = self.inner.state
        self._early: dict[int, float] = {}  # buckets updated in this window's backward -> their squared norm

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def step(self) -> StepResult:
        scale = self.loss_scale
        early, self._early = self._early, {}
        self.store.drain()  # updated during backward: on disk before the next forward reads them
        # 1. one all-reduce of the squared norms gives the global norm of the unscaled gradients;
        #    inf/nan there means a bad gradient on some rank
        norm = self.norm(self.buckets, scale, early)
        if self._skips(norm, len(early)):
            return StepResult(False, norm)
        # 2. clip, as torch.nn.utils.clip_grad_norm_ does
        coef = self._clip_coef(norm)
        # 3. update the buckets whose state the store has brought into memory (all of them, or
        #    one at a time as it streams them), then publish them to the compute parameters
        todo = [i for i in range(len(self.buckets)) if i not in early]
        after = dict(zip(todo, todo[1:]))
        for batch in self.store.batches(todo):  # each bucket once no background save still reads it
            if batch[-1] in after:  # streamed (NVMe): the next gradient is read meanwhile
                self.buckets[after[batch[-1]]].grads.prefetch()
            buckets = [self.buckets[i] for i in batch]
            self._update(buckets, [b.grads.take(scale, coef) for b in buckets])
        self.zero_grad()
        return StepResult(True, norm)

    # ---- optimizer_in_backward (shard/steps.py's BackwardSteps) ----
    def coming(self, buckets: list[Bucket]) -> None:
        """Their unit's backward begins: read their state meanwhile (NVMe)."""
        for b in buckets:
            self.store.ahead(b.layout.index)

    def reduced(self, bucket: Bucket) -> None:
        """The bucket's gradient is final: update and publish it now, as ``step()`` would (no
        clipping, no loss scale: the config allows neither), and free the gradient."""
        i = bucket.layout.index
        self._early[i] = bucket.grads.norm_sq(1.0)
        with self.store.behind(i):
            self._update([bucket], [bucket.grads.take(1.0, 1.0)])
        bucket.zero_grad()

    @property
    def updated_in_backward(self) -> int:
        """Buckets updated during backward whose step has not run yet."""
        return len(self._early)

    def abandon_backward(self) -> None:
        """A backward raised after updating some buckets: they keep their update (it cannot be
        undone); their writes land, and the next window starts afresh."""
        if self._early:
            logger.warning("backward failed after updating %d of %d buckets (optimizer_in_backward): "
                           "those keep this update; load a checkpoint to go back", len(self._early), len(self.buckets))
        self._early.clear()
        self.store.drain()

    def _clip_coef(self, norm: float) -> float:
        """What clip_grad_norm_ scales the gradients by (below 1.0 only when clipping applies)."""
        return self.clip / (norm + 1e-6) if self.clip is not None else 1.0

    def _skips(self, norm: float, updated: int = 0) -> bool:
        """Whether a non-finite norm skips this step: fp16 lowers the loss scale (and raises it
        after a clean window); otherwise nonfinite='raise' raises and 'skip' skips."""
        if self.scaler is not None:
            overflow = not math.isfinite(norm)
            self.scaler.update(overflow)
            if overflow:
                self._discard()
            return overflow
        if not math.isfinite(norm):
            self._nonfinite(updated)
            return True
        return False

    def _update(self, buckets: list[Bucket], grads: list[torch.Tensor]) -> None:
        for b, g in zip(buckets, grads):
            if b.layout.index in self.views.of:  # a whole-tensor group: the views of its tensors take the grad
                self.views.set_grads(b.layout.index, g)
            else:
                b.master.grad = g
        self.inner.step()  # parameters without .grad are skipped by every torch optimizer
        moved = False
        for b in buckets:
            b.master.grad = None
            if b.layout.index in self.views.of:
                self.views.set_grads(b.layout.index, None)
            for v in self.inner.state.get(b.master, {}).values():
                if isinstance(v, torch.Tensor) and v.dim():
                    moved |= align_storage(v)  # once, after torch allocated it: saves write it with O_DIRECT, uncopied
            self.collectives[b.layout.index].publish()
        if moved:
            trim_heap()  # what the moved state left behind

    def _nonfinite(self, updated: int = 0) -> None:
        """Name where NaN/Inf gradients came from, then raise everywhere or skip everywhere
        (``updated``: buckets that optimizer_in_backward updated before the norm was known)."""
        local = sorted({name for b in self.buckets for name in b.nonfinite})
        reports = self.group.allgather_object(local)
        where = "; ".join(f"rank {r}: {', '.join(names[:5])}" for r, names in enumerate(reports) if names)
        message = ("non-finite (NaN/Inf) gradient " + (f"from {where}" if where else
                   "after reduction (no rank saw one locally: the sum overflowed)"))
        self._discard()
        if updated:
            raise ZeroMPIError(message + f"; optimizer_in_backward had updated {updated} of {len(self.buckets)} "
                               "buckets already: load a checkpoint to go on")
        if self.nonfinite == NonFinite.RAISE:
            raise ZeroMPIError(message + "; set nonfinite='skip' to skip such steps instead")
        logger.warning("skipping the optimizer step: %s", message)

    def _discard(self) -> None:
        """A skipped step: drop its gradients, and what quantising them left for the next reduction."""
        self.zero_grad()
        for c in self.collectives:
            if c.grad_codes is not None:
                c.grad_codes.forget()

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()
            b.forget_nonfinite()

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors (scalars such as ``step`` excluded)."""
        total = 0
        for state in self.inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # resident bytes (0 when swapped out)
                    total += v.numel() * v.element_size()
        return total

    # ---- state, for checkpoints (checkpoint/snapshot.py's ShardStates) ----
    @property
    def streams(self) -> bool:
        return self.store.streams

    @contextmanager
    def resident(self, index: int, *, load: bool = True) -> Iterator[torch.Tensor]:
        """Bucket ``index``'s master, in memory for the block (its optimizer state is not looked at: a
        whole-tensor group's would be packed for nothing)."""
        with self.store.resident(index, load=load):
            yield self.buckets[index].master

    @contextmanager
    def shard_state(self, index: int, *, load: bool = True) -> Iterator[ShardState]:
        """Bucket ``index``'s master and optimizer state, in memory for the block."""
        with self.resident(index, load=load) as master:
            yield ShardState(master, self._state_of(index))

    def peek_state(self, index: int) -> dict[str, Any]:
        """Bucket ``index``'s optimizer state dict as it is (offloaded tensors may be empty): keys and scalars."""
        return dict(self._state_of(index))

    @contextmanager
    def fenced_state(self, index: int) -> Iterator[ShardState]:
        """Bucket ``index``'s master and state for a reader on another thread, while a fence holds it."""
        master = self.buckets[index].master
        with self.store.frozen(index) as readable:
            state = {k: readable(v) if isinstance(v, torch.Tensor) else v for k, v in self.peek_state(index).items()}
            yield ShardState(readable(master), state)

    def _state_of(self, index: int) -> dict[str, Any]:
        """Bucket ``index``'s optimizer state per element: the inner optimizer's own for a flat group, the
        tensors' states packed over the shard for a whole-tensor group (a copy)."""
        master = self.buckets[index].master
        if index in self.views.of:
            return self.views.pack(index, self.inner.state)
        return self.inner.state.get(master, {})

    def load_shard(self, index: int, master: torch.Tensor, state: dict[str, Any]) -> None:
        """Overwrite bucket ``index``'s master and state (tensors move to the master's device),
        publish it to the compute parameters and forget its gradient."""
        bucket = self.buckets[index]
        with self.store.resident(index, load=False):  # offloaded: overwritten, then swapped out
            with torch.no_grad():
                bucket.master.copy_(master)
            if index in self.views.of:
                self.views.unpack(index, self.inner.state, state)
            else:
                self.inner.state[bucket.master] = {
                    k: v.to(bucket.master.device) if isinstance(v, torch.Tensor) and v.dim() else v
                    for k, v in state.items()}
            self.collectives[index].publish()
        bucket.zero_grad()

    @property
    def partial_state(self) -> bool:
        """Some buckets' state is on their tensors' owners alone (whole-tensor groups): what a checkpoint
        records of it is gathered from every rank."""
        return bool(self.views.of)

    def tensor_states(self, index: int) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
        """(name, offset in the shard, state tensors) of bucket ``index``'s tensors that this rank steps, for
        a whole-tensor group's bucket (whole.py; none for a flat one); the live tensors."""
        return self.views.tensor_states(index, self.inner.state) if index in self.views.of else []

    def load_tensor_state(self, index: int, name: str, saved: dict[str, torch.Tensor]) -> None:
        """Add the saved state tensors ``saved`` of tensor ``name`` (bucket ``index``), after ``load_shard``."""
        self.views.load_tensor_state(index, self.inner.state, name, saved)

    def declared_state(self) -> tuple[Declared, ...]:
        """Its checkpointed state (checkpoint/snapshot.py's StateSource): each bucket's master and per-element
        state, and the whole-tensor groups' state per tensor, read and written through its ShardStates
        methods; its record in the index is checkpoint/optimizer_record.py's, from the same methods."""
        return (Declared(StateKind.OPTIMIZER_SHARDS, self), Declared(StateKind.TENSOR_STATES, self))

    def optimizer_names(self) -> list[str]:
        """Each param group's optimizer class, as ``module.QualName`` (checkpoints record them)."""
        return list(self.group_names)

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each param group's plain options (numbers, bools, tuples), without its params."""
        return [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, tuple, list))}
                for g in self.inner.param_groups]

    def load_hyperparameters(self, saved: list[dict[str, Any]]) -> None:
        """Restore the numeric options the groups already have (bools and unknown keys are kept).

        The checkpoint's values win, as in torch's ``Optimizer.load_state_dict`` and DeepSpeed's
        ``load_checkpoint``: a resume continues the run it resumes. Options the config changed since are
        named in a warning (rank 0), with how to train on with the new ones."""
        changes = changed_on_resume(self.hyperparameters(), saved)
        if changes and self.group.rank == 0:
            logger.warning("the checkpoint's optimizer options differ from this engine's config and win, as in "
                           "torch's load_state_dict: %s. To train on with the config's, set them after "
                           "load_checkpoint: engine.optimizer.param_groups[i][key] = value (for lr under a "
                           "schedule, engine.lr_scheduler.base_lrs[i] too)", "; ".join(changes))
        for group, options in zip(self.inner.param_groups, saved):
            for k, v in options.items():
                if k in group and isinstance(group[k], (int, float, tuple, list)) and not isinstance(group[k], bool):
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v

    def scaler_state(self) -> dict[str, Any] | None:
        s = self.scaler
        return None if s is None else {"scale": s.scale, "good_steps": s.good_steps,
                                       "hysteresis_left": s.hysteresis_left}

    def load_scaler_state(self, saved: dict[str, Any] | None) -> None:
        if self.scaler is not None and saved:
            self.scaler.scale = float(saved["scale"])
            self.scaler.good_steps = int(saved["good_steps"])
            self.scaler.hysteresis_left = int(saved["hysteresis_left"])

    def close(self) -> None:
        self.store.close()
