"""Which optimizers step flat shards, which step whole tensors, and which the engine cannot run.

The engine steps one flat fp32 shard per bucket. That is the per-tensor update exactly when each
element's step depends on its own gradient and state alone (Adam, AdamW, SGD, ...). An optimizer
that looks at a whole tensor (Adafactor's factored second moment, Muon's orthogonalisation, a
norm-based trust ratio) would see a 1-D slice of several tensors instead, so its groups step whole
tensors, each on one owner rank (optim/whole.py). LBFGS (a closure) and SparseAdam (sparse
gradients) cannot run at all and are refused by name.

A class is element-wise when it is one of torch's listed below, or when it declares so itself
with a class attribute ``elementwise = True`` (the :class:`ElementWise` protocol). Nothing else is
presumed: a subclass of a listed class may change the arithmetic, so it steps whole tensors unless
it declares itself element-wise too.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from zerompi.errors import ConfigError, UsageError

_O = torch.optim
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    _O.Adam, _O.AdamW, _O.SGD, _O.Adagrad, _O.Adadelta, _O.Adamax, _O.ASGD, _O.NAdam, _O.RAdam, _O.RMSprop, _O.Rprop)
"""torch optimizers whose update is element-wise: a flat shard of the parameters steps as they would."""


@runtime_checkable
class ElementWise(Protocol):
    """An optimizer class that declares its update element-wise (so flat shards step exactly)."""

    elementwise: ClassVar[bool]


def is_elementwise(cls: type) -> bool:
    """Whether ``cls`` updates each element from its own gradient and state alone."""
    return cls in ELEMENTWISE or vars(cls).get("elementwise") is True


UNSUPPORTED: dict[type[torch.optim.Optimizer], str] = {
    _O.LBFGS: "its step needs a closure that evaluates the loss again, several times, which a step over "
              "sharded gradients cannot",
    _O.SparseAdam: "it takes sparse gradients, and the engine reduces dense ones"}
"""torch optimizers the engine cannot run at all, and why."""


def check_supported(value: Any, cls: type, key: str = "optimizer") -> None:
    """Refuse (ConfigError naming ``key``) an optimizer the engine cannot run, element-wise or not;
    ``value`` is the optimizer as given (the config's ``optimizer``, or a param group's)."""
    for refused, why in UNSUPPORTED.items():
        if issubclass(cls, refused):
            raise ConfigError(f"{key}={value!r}: {cls.__module__}.{cls.__qualname__} cannot run here: {why}; "
                              "allowed: any other torch.optim optimizer")


GROUP_KEYS = ("param_names", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr")
"""Param-group keys torch's optimizers (named parameters) and lr schedulers (OneCycleLR, CyclicLR,
SWALR, ...) keep beside the constructor's options."""


def group_keys(cls: type) -> set[str]:
    """The param-group keys ``cls`` takes: its constructor's options and its optimizer bases' (a
    subclass's defaults include them), and GROUP_KEYS."""
    return {name for base in cls.__mro__ if issubclass(base, torch.optim.Optimizer)
            and base is not torch.optim.Optimizer
            for name in inspect.signature(base).parameters} - {"params"} | set(GROUP_KEYS)


def check_group_options(cls: type, group_options: list[dict[str, Any]] | Mapping[int, dict[str, Any]]) -> None:
    """Refuse a param-group key ``cls`` does not take, naming it (torch would keep it and use it for
    nothing). ``group_options``: every group's options, or some groups' by their index."""
    accepted = group_keys(cls)
    indexed = group_options.items() if isinstance(group_options, Mapping) else enumerate(group_options)
    for i, options in indexed:
        unknown = sorted(str(k) for k in options if k not in accepted)
        if unknown:
            raise UsageError(f"param_groups[{i}] sets {', '.join(repr(k) for k in unknown)}, which "
                             f"{cls.__name__} does not take; allowed: " + ", ".join(sorted(accepted))
                             + " (and 'optimizer', a class of the group's own)")
