"""ZeroOptimizer: any element-wise ``torch.optim`` optimizer on this rank's fp32 shards.

The inner optimizer sees one flat fp32 tensor per bucket (the master shard)
instead of the model's parameters. Element-wise optimizers (Adam, AdamW,
SGD, Adagrad, ...) compute the same update on a flat shard as on the
parameters it came from; optimizers that look at whole tensors (LAMB's
trust ratio, Shampoo) would not, and are not supported.

``step()`` reads as its four phases: unscale, one all-reduce for the global
gradient norm (which also detects fp16 overflow), clip, update and publish.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from zerompi.shard.bucket import Bucket
from zerompi.dist.group import ProcessGroup
from zerompi.errors import ZeroMPIError
from zerompi.log import get_logger
from zerompi.offload.residency import InMemory
from zerompi.optim.precision import LossScaler

logger = get_logger(__name__)


class StepResult(NamedTuple):
    stepped: bool
    grad_norm: float | None


def optimizer_kwargs(cfg) -> dict[str, Any]:
    """Constructor arguments for the configured optimizer."""
    name = cfg.optimizer if isinstance(cfg.optimizer, str) else ""
    if name in ("adamw", "adam"):
        base = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    elif name == "sgd":
        base = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        base = dict(lr=cfg.lr)
    return {**base, **cfg.optimizer_kwargs}


class ZeroOptimizer:
    """Runs ``cfg.optimizer`` over the buckets' master shards.

    Args:
        buckets: every bucket of the sharded model.
        cfg: the ZeroConfig.
        group: the data-parallel group (for the norm all-reduce).
        group_options: per optimizer param group overrides (e.g. weight_decay).
    """

    def __init__(self, buckets: list[Bucket], cfg, group: ProcessGroup,
                 group_options: list[dict[str, Any]]):
        self.buckets = buckets
        self.group = group
        self.clip = cfg.clip_grad_norm
        self.nonfinite = cfg.nonfinite
        self.replicated = cfg.stage == 0  # every rank holds every gradient: no norm all-reduce
        self.scaler = LossScaler.from_config(cfg) if cfg.dtype == "fp16" else None
        groups = []
        for gi, options in enumerate(group_options):
            masters = [b.master for b in buckets if b.layout.group == gi]
            if masters:
                groups.append({**options, "params": masters})
        self.inner = cfg.optimizer_class()(groups, **optimizer_kwargs(cfg))
        self.store = InMemory(buckets, self.inner)  # engine swaps in NVMeResidency for nvme offload

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        return self._norm_from(sum(float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in grads))

    def _norm_from(self, local: float) -> float:
        """The global norm from this rank's sum of squares."""
        if not self.replicated:
            # over the shard group: its shards cover every element once (hsdp replicas would repeat it)
            local = self.buckets[0].groups.shard.sum_floats([local], what="the global gradient norm")[0]
        return math.sqrt(local)

    def step(self) -> StepResult:
        if self.buckets and self.buckets[0].grad_swap is not None:
            return self._swapped_step()
        # 1. unscale: this rank's reduced gradient shards, in fp32
        grads = [b.master_grad() for b in self.buckets]
        if self.loss_scale != 1.0:
            for g in grads:
                g.div_(self.loss_scale)
        # 2. one all-reduce gives the global norm; inf/nan there means a bad gradient on some rank
        norm = self._global_norm(grads)
        if self._skips(norm):
            return StepResult(False, norm)
        # 3. clip, as torch.nn.utils.clip_grad_norm_ does
        coef = self._clip_coef(norm)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        # 4. update the shards, then publish them to the compute parameters
        if self.store.streaming:  # one bucket at a time through memory; the others have no grad
            for i in self.store.stream():
                self._update([self.buckets[i]], [grads[i]])
        else:
            self._update(self.buckets, grads)
        self.zero_grad()
        return StepResult(True, norm)

    def _clip_coef(self, norm: float) -> float:
        """What clip_grad_norm_ scales the gradients by (below 1.0 only when clipping applies)."""
        return self.clip / (norm + 1e-6) if self.clip is not None else 1.0

    def _skips(self, norm: float) -> bool:
        """Whether a non-finite norm skips this step: fp16 lowers the loss scale (and raises it
        after a clean window); otherwise nonfinite='raise' raises and 'skip' skips."""
        if self.scaler is not None:
            overflow = not math.isfinite(norm)
            self.scaler.update(overflow)
            if overflow:
                self.zero_grad()
            return overflow
        if not math.isfinite(norm):
            self._nonfinite()
            return True
        return False

    def _swapped_step(self) -> StepResult:
        """The step with gradient shards in the swap file: the norm comes from the squares kept
        at reduction time (fp16: of the scaled gradients, then unscaled), and each bucket's
        gradient is read, unscaled and clipped as its optimizer state streams through."""
        norm = self._norm_from(sum(b.grad_sq for b in self.buckets)) / self.loss_scale
        if self._skips(norm):
            return StepResult(False, norm)
        coef = self._clip_coef(norm)
        for i in self.store.stream():
            g = self.buckets[i].master_grad()
            if self.loss_scale != 1.0:
                g.div_(self.loss_scale)
            if coef < 1.0:
                g.mul_(coef)
            self._update([self.buckets[i]], [g])
        self.zero_grad()
        return StepResult(True, norm)

    def _update(self, buckets: list[Bucket], grads: list[torch.Tensor]) -> None:
        for b, g in zip(buckets, grads):
            b.master.grad = g
        self.inner.step()  # parameters without .grad are skipped by every torch optimizer
        for b in buckets:
            b.master.grad = None
            b.publish()

    def _nonfinite(self) -> None:
        """Name where NaN/Inf gradients came from, then raise everywhere or skip everywhere."""
        local = sorted({name for b in self.buckets for name in b.nonfinite})
        reports = self.group.allgather_object(local)
        where = "; ".join(f"rank {r}: {', '.join(names[:5])}" for r, names in enumerate(reports) if names)
        message = ("non-finite (NaN/Inf) gradient " + (f"from {where}" if where else
                   "after reduction (no rank saw one locally: the sum overflowed)"))
        self.zero_grad()
        if self.nonfinite == "raise":
            raise ZeroMPIError(message + "; set nonfinite='skip' to skip such steps instead")
        logger.warning("skipping the optimizer step: %s", message)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()
            b.nonfinite.clear()

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors (scalars such as ``step`` excluded)."""
        total = 0
        for state in self.inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # resident bytes (0 when swapped out)
                    total += v.numel() * v.element_size()
        return total
