"""Param groups that choose their own optimizer: ``{"params": ..., "optimizer": torch.optim.SGD, "lr": 0.1}``.

A group without an ``"optimizer"`` key runs the config's optimizer, with the config's hyperparameters as
defaults and its own keys on top, as in torch. A group with one runs that class (a class, or its dotted
name), built with its own keys only: ``lr`` defaults to the config's (the built-in schedules are relative
to each group's lr), the kernel is chosen as for the config's optimizer (optim/optimizer.py), and nothing
else of the config's hyperparameters reaches it. A class that updates element-wise (kinds.py) steps the
group's flat master shards; any other steps whole tensors, on their owners (whole.py); one the engine cannot
run at all (a closure, sparse gradients) is refused naming ``param_groups[i]['optimizer']``.

When every group runs the config's element-wise optimizer, one torch optimizer runs them all, as before;
otherwise there is one per group. They share one ``state`` dict (:class:`InnerOptimizers`), keyed by master
shard for flat groups, so the offload stores and checkpoints that look a bucket's state up by its master do
not see how many there are.
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
from zerompi.optim.whole import TensorViews

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
    elementwise: bool = True  # steps flat shards (else whole tensors, on their owners)


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def group_optimizers(policy: OptimizerPolicy, group_options: list[dict[str, Any]],
                     swapped: bool = False) -> list[GroupOptimizer]:
    """Each group's optimizer, checked: a class the engine runs, options it takes (ConfigError or UsageError
    naming the group and key). ``swapped``: the optimizer state is swapped to NVMe bucket by bucket, which a
    whole-tensor optimizer's per-tensor state cannot follow yet (host memory, 'cpu', it can)."""
    out = []
    for i, options in enumerate(group_options):
        own = KEY in options
        key = f"param_groups[{i}][{KEY!r}]" if own else "optimizer"
        value = options[KEY] if own else policy.optimizer
        cls = checks.optimizer_class(key, value)
        kinds.check_supported(value, cls, key=key)
        elementwise = kinds.is_elementwise(cls)
        if swapped and not elementwise:
            raise ConfigError(f"{key}={value!r} steps whole tensors, whose state cannot be swapped to NVMe yet; "
                              "allowed with offload_optimizer='none' or 'cpu', or an element-wise optimizer")
        rest = {k: v for k, v in options.items() if k != KEY}
        kinds.check_group_options(cls, {i: rest})
        kernels = [k for k in ("fused", "foreach") if rest.get(k)]
        if policy.deterministic and kernels:  # as config/reproducible.py refuses them in optimizer_kwargs
            raise ConfigError(f"param_groups[{i}][{kernels[0]!r}]=True with reproducible=True: the for-loop "
                              "kernel computes an element the same way wherever shards cut; allowed: False")
        out.append(GroupOptimizer(cls, _path(cls), own, rest, elementwise))
    return out


def check_tensors(specs: list[GroupOptimizer], params: list[tuple[str, tuple[int, ...], int]]) -> None:
    """Refuse, naming the parameter, a tensor a whole-tensor optimizer refuses (Muon: not 2-D); ``params``:
    (name, shape, group) of every trainable parameter. The optimizer itself is asked, on a meta tensor."""
    for name, shape, gi in params:
        spec = specs[gi]
        if spec.elementwise:
            continue
        options = {k: v for k, v in spec.options.items() if k not in KERNEL_KEYS}
        try:
            spec.cls([torch.empty(shape, device="meta")], **options)
        except (ValueError, TypeError, RuntimeError) as e:
            key = f"param_groups[{gi}][{KEY!r}]" if spec.own else "optimizer"
            raise ConfigError(f"{key}: {spec.cls.__name__} refuses parameter {name!r} of shape {list(shape)}: {e}; "
                              "put it in a group of another optimizer") from None


class InnerOptimizers:
    """The torch optimizers of one ZeroOptimizer as one: their param groups in the user's order, one state."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.state = optimizers[0].state
        for other in optimizers[1:]:
            other.state = self.state  # keys are master shards (or tensor views), each in one optimizer only
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.defaults = optimizers[0].defaults

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def build(specs: list[GroupOptimizer], buckets: list, policy: OptimizerPolicy,
          kwargs_for: Callable[[OptimizerPolicy], dict[str, Any]]) -> tuple[InnerOptimizers, list[str], TensorViews]:
    """The inner optimizers over the trainable ``buckets`` of each group (groups without any are left out),
    the class name of each group kept, in order, and the tensor views of the whole-tensor groups' buckets.
    ``kwargs_for(policy)``: the constructor arguments a policy gives (optimizer.py's ``optimizer_kwargs``
    on the masters' device)."""
    of_group = [[b for b in buckets if b.layout.group == gi] for gi in range(len(specs))]
    kept = [(spec, bs) for spec, bs in zip(specs, of_group) if bs]
    views = TensorViews([b for spec, bs in kept if not spec.elementwise for b in bs])
    names = [spec.name for spec, _ in kept]
    if all(spec.elementwise and not spec.own for spec, _ in kept):  # the config's optimizer over every group
        groups = [{**spec.options, "params": [b.master for b in bs]} for spec, bs in kept]
        return InnerOptimizers([policy.optimizer_class()(groups, **kwargs_for(policy))]), names, views
    optimizers = []
    for spec, bs in kept:
        params = [b.master for b in bs] if spec.elementwise else [v for b in bs for v in views.params(b.layout.index)]
        if spec.own:  # the group's keys are its options; lr defaults to the config's, the kernel as for it
            kernel = {k: v for k, v in spec.options.items() if k in KERNEL_KEYS}
            group_policy = dataclasses.replace(policy, optimizer=spec.cls, kwargs=kernel)
        else:
            group_policy = policy
        optimizers.append(spec.cls([{**spec.options, "params": params}], **kwargs_for(group_policy)))
    return InnerOptimizers(optimizers), names, views


def changed_on_resume(current: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[str]:
    """The options this engine was built with that a checkpoint's differ from, as ``group i: lr 0.01 here,
    0.001 in the checkpoint``. A schedule moves ``lr`` by design: where a group has ``initial_lr`` (set by
    a torch scheduler), that is the value the config gave and the one compared."""
    changes = []
    for i, (now, then) in enumerate(zip(current, saved)):
        for key, value in now.items():
            if key == "lr" and "initial_lr" in now or key not in then or isinstance(value, bool):
                continue
            old = tuple(then[key]) if isinstance(value, tuple) else then[key]
            if old != value:
                changes.append(f"group {i}: {key} {value!r} here, {old!r} in the checkpoint")
    return changes
