"""The optimization section: the optimizer, its hyperparameters, clipping, non-finite gradients and
the built-in learning-rate schedule.

``cfg.optimization`` (what ZeroOptimizer is built from) and ``cfg.lr_policy`` (optim/schedules.py)
are the policies built from these keys once."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import NonFinite, Schedule


@dataclass(frozen=True)
class OptimizerPolicy:
    """The inner optimizer and its update: what ZeroOptimizer (and a reference optimizer) is built from."""

    optimizer: Any
    """'adamw', 'adam', 'sgd', an Optimizer subclass or a dotted path to one (checked)."""
    kwargs: dict
    """Extra constructor arguments (optimizer_kwargs)."""
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    momentum: float
    clip_grad_norm: float | None
    """Clip the global gradient norm to this (None: no clipping)."""
    nonfinite: NonFinite
    """A NaN/Inf gradient in fp32/bf16: raise or skip the step (fp16 always skips)."""
    deterministic: bool = False
    """reproducible=True: the for-loop kernel, which computes an element the same way wherever
    shard boundaries fall (a fused or multi-tensor kernel treats a tensor's last elements apart)."""

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch.optim.Optimizer subclass that ``optimizer`` names."""
        return checks.optimizer_class("optimizer", self.optimizer)


@dataclass(frozen=True)
class LrSchedulePolicy:
    """The built-in learning-rate schedule (optim/schedules.py)."""

    schedule: Schedule
    lr: float
    warmup_steps: int
    total_steps: int | None
    min_lr: float


@dataclass(frozen=True, kw_only=True)
class OptimizationKeys:
    """The optimization section's keys (ZeroConfig's fields) and its policy."""

    optimizer: str | type[torch.optim.Optimizer] = key("adamw", checks.kept_optimizer)
    """'adamw', 'adam', 'sgd', an Optimizer subclass or 'package.module.ClassName' to one; or 'muon': Muon on
    the hidden matrices and AdamW on the rest (optim/presets.py states the rule), optimizer_kwargs for Muon."""
    optimizer_kwargs: dict = key(check=checks.str_mapping, factory=dict, policy="kwargs")
    """Extra optimizer arguments; str keys other than 'params' and those set by fields."""
    lr: float = key(1e-3, checks.positive, spelled={"DeepSpeed": "optimizer.params.lr"})
    """Learning rate, finite and > 0."""
    betas: tuple[float, float] = key((0.9, 0.999), checks.betas, spelled={"DeepSpeed": "optimizer.params.betas"})
    """Adam coefficients, each in [0, 1); a list of two numbers becomes a tuple."""
    eps: float = key(1e-8, checks.positive, spelled={"DeepSpeed": "optimizer.params.eps"})
    """Adam denominator term, > 0."""
    weight_decay: float = key(0.01, checks.nonnegative, spelled={"DeepSpeed": "optimizer.params.weight_decay"})
    """Weight decay, >= 0."""
    momentum: float = key(0.0, checks.nonnegative, spelled={"DeepSpeed": "optimizer.params.momentum"})
    """SGD momentum, >= 0."""
    clip_grad_norm: float | None = key(None, checks.clip_norm, spelled={"DeepSpeed": "gradient_clipping"})
    """Global gradient norm limit, > 0; None disables clipping (0 is stored as None)."""
    nonfinite: NonFinite = key(NonFinite.RAISE, checks.of(NonFinite))
    """A NaN/Inf gradient in fp32/bf16: 'raise' (naming rank and parameter) or 'skip' the step
    on every rank. fp16 always skips and lowers the loss scale."""
    lr_schedule: Schedule = key(Schedule.CONSTANT, checks.of(Schedule), policy="schedule")
    """Learning-rate schedule the engine steps after each optimizer step: 'constant' (lr
    throughout), 'warmup_cosine' or 'warmup_linear' (linear warm-up from lr/warmup_steps to lr
    over warmup_steps steps, then cosine or linear decay to min_lr at total_steps, min_lr after).
    Per optimizer param group, relative to that group's lr. ``initialize(lr_scheduler=fn)``
    takes any torch.optim.lr_scheduler instead."""
    warmup_steps: int = key(0, checks.whole(0))
    """Optimizer steps of linear warm-up, >= 0."""
    total_steps: int | None = key(None, checks.maybe(checks.whole(1), "no decay"))
    """The optimizer step at which a decaying schedule reaches min_lr; > warmup_steps. None only
    with lr_schedule='constant'."""
    min_lr: float = key(0.0, checks.nonnegative)
    """The learning rate a decaying schedule ends at, 0 <= min_lr <= lr (a group with another lr
    ends at min_lr scaled by that group's lr / lr)."""

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch.optim.Optimizer subclass that ``optimizer`` names."""
        return checks.optimizer_class("optimizer", self.optimizer)

    @cached_property
    def optimization(self) -> OptimizerPolicy:
        """The optimizer, its hyperparameters, clipping and non-finite gradients."""
        # The batch section's reproducible picks the kernel: the one key read across sections.
        return build(OptimizerPolicy, self, OptimizationKeys, deterministic=self.reproducible)

    @cached_property
    def lr_policy(self) -> LrSchedulePolicy:
        """The built-in learning-rate schedule."""
        return build(LrSchedulePolicy, self, OptimizationKeys)
