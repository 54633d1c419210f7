"""Param groups that choose their own optimizer: ``{"params": ..., "optimizer": torch.optim.SGD, "lr": 0.1}``.

A group without an ``"optimizer"`` key runs the config's optimizer, with the config's hyperparameters as
defaults and its own keys on top, as in torch. A group with one runs that class (a class, or its dotted
name), built with its own keys only: ``lr`` defaults to the config's (the built-in schedules are relative
to each group's lr), the kernel is chosen as for the config's optimizer (optim/optimizer.py), and nothing
else of the config's hyperparameters reaches it. Every class must update element-wise (kinds.py): a group's
is refused naming ``param_groups[i]['optimizer']``.

When no group chooses, one torch optimizer runs every group, as before; otherwise there is one per group.
Either way they share one ``state`` dict keyed by master shard (:class:`InnerOptimizers`), so the offload
stores and checkpoints that look a bucket's state up by its master do not see how many there are.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from zerompi.config import checks
from zerompi.config.sections import OptimizerPolicy
from zerompi.errors import ConfigError
from zerompi.optim import kinds

KEY = "optimizer"
"""The param-group key that chooses a group's own optimizer."""
KERNEL_KEYS = ("fused", "foreach", "differentiable", "capturable")
"""Options that choose torch's implementation themselves: with any of them, no default kernel."""


class GroupOptimizer(NamedTuple):
    """One param group's optimizer: its class, how it was named, and the group's options without it."""

    cls: type[torch.optim.Optimizer]
    name: str       # module.QualName, as checkpoints record it
    own: bool       # the group chose it (else the config's)
    options: dict[str, Any]


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def group_optimizers(policy: OptimizerPolicy, group_options: list[dict[str, Any]]) -> list[GroupOptimizer]:
    """Each group's optimizer, checked: an element-wise class, options it takes (ConfigError or UsageError
    naming the group and key)."""
    out = []
    for i, options in enumerate(group_options):
        own = KEY in options
        key = f"param_groups[{i}][{KEY!r}]" if own else "optimizer"
        value = options[KEY] if own else policy.optimizer
        cls = checks.optimizer_class(key, value)
        kinds.check_elementwise(value, cls, key=key)
        rest = {k: v for k, v in options.items() if k != KEY}
        kinds.check_group_options(cls, {i: rest})
        kernels = [k for k in ("fused", "foreach") if rest.get(k)]
        if policy.deterministic and kernels:  # as config/reproducible.py refuses them in optimizer_kwargs
            raise ConfigError(f"param_groups[{i}][{kernels[0]!r}]=True with reproducible=True: the for-loop "
                              "kernel computes an element the same way wherever shards cut; allowed: False")
        out.append(GroupOptimizer(cls, _path(cls), own, rest))
    return out


class InnerOptimizers:
    """The torch optimizers of one ZeroOptimizer as one: their param groups in the user's order, one state."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.state = optimizers[0].state
        for other in optimizers[1:]:
            other.state = self.state  # keys are master shards, each in one optimizer only
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.defaults = optimizers[0].defaults

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def build(specs: list[GroupOptimizer], masters: list[list[torch.Tensor]], policy: OptimizerPolicy,
          kwargs_for: Callable[[OptimizerPolicy], dict[str, Any]]) -> tuple[InnerOptimizers, list[str]]:
    """The inner optimizers over each group's ``masters`` (groups without any are left out, as torch
    would hold them empty), and the class name of each group kept, in order. ``kwargs_for(policy)``: the
    constructor arguments a policy gives (optimizer.py's ``optimizer_kwargs`` on the masters' device)."""
    kept = [(spec, m) for spec, m in zip(specs, masters) if m]
    if not any(spec.own for spec, _ in kept):  # every group runs the config's optimizer: one over all
        groups = [{**spec.options, "params": m} for spec, m in kept]
        return InnerOptimizers([policy.optimizer_class()(groups, **kwargs_for(policy))]), [s.name for s, _ in kept]
    optimizers = []
    for spec, m in kept:
        if spec.own:  # the group's keys are its options; lr defaults to the config's, the kernel as for it
            kernel = {k: v for k, v in spec.options.items() if k in KERNEL_KEYS}
            own = dataclasses.replace(policy, optimizer=spec.cls, kwargs=kernel)
            optimizers.append(spec.cls([{**spec.options, "params": m}], **kwargs_for(own)))
        else:
            optimizers.append(spec.cls([{**spec.options, "params": m}], **kwargs_for(policy)))
    return InnerOptimizers(optimizers), [s.name for s, _ in kept]
