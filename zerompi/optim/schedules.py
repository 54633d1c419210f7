"""Learning-rate schedules: the config's built-in ones, and stepping any torch scheduler.

The built-in schedules are ``torch.optim.lr_scheduler.LambdaLR`` with a factor
object per param group, so they behave like any torch scheduler: the engine
steps them after each optimizer step that updated (an fp16 overflow skip does
not advance them), their ``state_dict()`` is plain numbers (saved as JSON in
the checkpoint index) and ``load_state_dict`` restores them.

Optimizer step k (0-based) uses ``lr * factor(k)``:

* warm-up, k < W: ``(k + 1) / W`` (the first step already learns: lr / W);
* decay, W <= k < T: ``r + (1 - r) * d(p)`` with ``p = (k - W) / (T - W)``, ``r = min_lr / lr``
  and ``d(p) = (1 + cos(pi p)) / 2`` (cosine) or ``1 - p`` (linear);
* after, k >= T: ``r``.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerompi.config.choices import Schedule
from zerompi.config.sections import LrSchedulePolicy
from zerompi.errors import UsageError

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass
class WarmupDecay:
    """The factor on a group's lr at optimizer step k (see the module docstring)."""

    warmup_steps: int
    total_steps: int
    min_ratio: float
    cosine: bool

    def __call__(self, k: int) -> float:
        if k < self.warmup_steps:
            return (k + 1) / self.warmup_steps
        if k >= self.total_steps:
            return self.min_ratio
        p = (k - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        decay = 0.5 * (1.0 + math.cos(math.pi * p)) if self.cosine else 1.0 - p
        return self.min_ratio + (1.0 - self.min_ratio) * decay


def from_policy(policy: LrSchedulePolicy) -> SchedulerFactory | None:
    """The factory of the configured scheduler (``cfg.lr_policy``); None for 'constant'."""
    if policy.schedule == Schedule.CONSTANT:
        return None
    factor = WarmupDecay(policy.warmup_steps, policy.total_steps, policy.min_lr / policy.lr,
                         cosine=policy.schedule == Schedule.WARMUP_COSINE)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, [factor] * len(optimizer.param_groups))


def build(factory: SchedulerFactory | None, optimizer: torch.optim.Optimizer):
    """Call the user's (or the config's) factory on the engine's optimizer; check what it made."""
    if factory is None:
        return None
    scheduler = factory(optimizer)
    if not (hasattr(scheduler, "step") and hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
        raise UsageError(f"lr_scheduler(optimizer) returned {type(scheduler).__name__}, which has no "
                         "step/state_dict/load_state_dict: return a torch.optim.lr_scheduler scheduler")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise UsageError("lr_scheduler(optimizer) returned a scheduler of another optimizer: build it on the "
                         "optimizer it is given (engine.optimizer)")
    return scheduler


def saved_state(scheduler) -> dict[str, Any] | None:
    """A scheduler's state_dict, checked to be JSON (numbers, lists, dicts), as the checkpoint index
    stores it; None without a scheduler."""
    if scheduler is None:
        return None
    state = scheduler.state_dict()
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UsageError(f"the state of lr scheduler {type(scheduler).__name__} cannot be saved as JSON ({e}); "
                         "a checkpoint stores only numbers, strings and lists") from e
    return state
