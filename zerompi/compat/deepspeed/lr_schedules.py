"""DeepSpeed's learning-rate schedules, as LambdaLR factors that reproduce its numbers step for step.

DeepSpeed steps its scheduler after each optimizer step that updated, as zerompi does,
and sets the learning rates once when the scheduler is built. So optimizer step k
(0-based) runs at DeepSpeed's value for iteration ``i = k - 1``, where i = -1 is
"not started" (WarmupLR/WarmupDecayLR: ``warmup_min_lr``; WarmupCosineLR: 0). With
W = warmup_num_steps (already max(2, given)) and T = total_num_steps:

* warm-up, 0 <= i < W: ``g = log(i + 1) / log(W)`` (log) or ``i / W`` (linear);
  WarmupLR/WarmupDecayLR run at ``min + (max - min) g``, WarmupCosineLR at the group's
  lr times ``r0 + (1 - r0) g`` (r0 = warmup_min_ratio);
* after, i >= W: WarmupLR at ``max``; WarmupDecayLR at ``min + (max - min) g`` with
  ``g = clamp((T - i) / max(1, T - W), 0, 1)``; WarmupCosineLR at the group's lr times
  ``max(0, c + (1 - c)(1 + cos(pi p)) / 2)``, ``p = min(1, (i - W + 1) / max(1, T - W))``,
  c = cos_min_ratio.

W = 0 (an "auto" warm-up resolved to zerompi's warmup_steps=0) skips the warm-up and the
"not started" step: every step follows the "after" formulas. ``min`` and ``max`` are
absolute learning rates (``max`` None: the group's own lr); LambdaLR multiplies a factor
by the group's lr, so those factors divide by it (equal to DeepSpeed's value within one
rounding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zerompi.compat.deepspeed.schedule import DeepSpeedSchedule
from zerompi.errors import UsageError
from zerompi.optim.schedules import SchedulerFactory


@dataclass
class DeepSpeedFactor:
    """The factor on one param group's lr at optimizer step k (see the module docstring)."""

    cosine: bool
    decay: bool
    warmup_num_steps: int
    warmup_log: bool
    total_num_steps: int
    low: float
    """Warm-up start: an absolute lr, or (cosine) the ratio warmup_min_ratio."""
    high: float
    """Warm-up end: an absolute lr, or (cosine) 1."""
    base_lr: float
    """The group's lr, which LambdaLR multiplies the factor by (1 for cosine: ratios already are factors)."""
    cos_min_ratio: float

    def value(self, k: int) -> float:
        """DeepSpeed's learning rate (or, for cosine, ratio) at optimizer step k."""
        i, w = k - 1, self.warmup_num_steps
        if i < 0 and w > 0:
            return 0.0 if self.cosine else self.low
        if 0 <= i < w:
            gamma = (1.0 / math.log(w)) * math.log(i + 1) if self.warmup_log else i / w
            return self.low + gamma * (self.high - self.low) if self.cosine \
                else self.low + (self.high - self.low) * gamma
        if self.cosine:
            p = min(1.0, (i - w + 1) / max(1, self.total_num_steps - w))
            return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ((1 + math.cos(math.pi * p)) / 2))
        if not self.decay:
            return self.low + (self.high - self.low) * 1.0
        gamma = max(0.0, float(self.total_num_steps - i) / float(max(1.0, self.total_num_steps - w)))
        return self.low + (self.high - self.low) * min(1.0, gamma)

    def __call__(self, k: int) -> float:
        return self.value(k) / self.base_lr


def factor_for(spec: DeepSpeedSchedule, group_lr: float) -> DeepSpeedFactor:
    """The factor of ``spec`` for a param group whose lr is ``group_lr``."""
    cosine = spec.kind == "WarmupCosineLR"
    if not cosine and not group_lr > 0:
        raise UsageError(f"{spec.kind} sets absolute learning rates, which a param group with lr={group_lr!r} "
                         "cannot be scaled to: give every param group an lr > 0")
    high = 1.0 if cosine else (spec.warmup_max_lr if spec.warmup_max_lr is not None else group_lr)
    return DeepSpeedFactor(cosine=cosine, decay=spec.kind == "WarmupDecayLR",
                           warmup_num_steps=spec.warmup_num_steps, warmup_log=spec.warmup_log,
                           total_num_steps=spec.total_num_steps or 0,
                           low=spec.warmup_min_ratio if cosine else spec.warmup_min_lr, high=high,
                           base_lr=1.0 if cosine else group_lr, cos_min_ratio=spec.cos_min_ratio)


def scheduler_factory(spec: DeepSpeedSchedule) -> SchedulerFactory:
    """``lr_scheduler=`` for an engine: a LambdaLR with one :class:`DeepSpeedFactor` per param group."""
    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        factors = [factor_for(spec, float(g["lr"])) for g in optimizer.param_groups]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
    return build
