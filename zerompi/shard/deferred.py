"""Deferred initialisation: a model built on the meta device, materialised bucket by bucket.

A model too large for one rank's memory cannot be built whole on every rank
before it is sharded. Built under ``torch.device("meta")`` it holds shapes and
no storage; the sharded model then materialises the modules of one bucket at
a time (``Materializer``), initialises them with ``param_init(module)``,
copies their values into the bucket, and lets the full tensors go. Peak
memory is one bucket's worth, not the model's. As for eager models, every
rank starts from rank 0's values (the bucket's initial values are broadcast).

The values differ from an eager build with the same seed (the random numbers
are drawn in another order), with the same distributions. Parameters that go
into buckets may be on the meta device: the trainable ones, and at stage 3 the
frozen ones that are sharded too (a frozen base larger than memory); frozen
parameters that stay replicated (stages 0-2, or below the persistence
threshold) and buffers are held whole anyway and must be real.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import Callable

import torch
from torch import nn

from zerompi.errors import UsageError

ParamInit = Callable[[nn.Module], None]


def reset_parameters(module: nn.Module) -> None:
    """The default ``param_init``: the module's own ``reset_parameters()``."""
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise UsageError(f"{type(module).__name__} has parameters on the meta device and no "
                         "reset_parameters(); pass param_init= to zerompi.initialize")
    reset()


def check(module: nn.Module, bucketed: Collection[str]) -> None:
    """Only parameters that go into buckets (the fqns ``bucketed``, placement.py) may wait on the
    meta device: trainable ones, and frozen ones that stage 3 shards."""
    bad = [n for n, p in module.named_parameters() if p.is_meta and n not in bucketed]
    bad += [n for n, b in module.named_buffers() if b.is_meta]
    if bad:
        raise UsageError(f"these frozen parameters or buffers must not be on the meta device (they are "
                         f"replicated whole; stage 3 shards frozen parameters of at least "
                         f"param_persistence_threshold elements): {', '.join(bad[:5])}")


def to_device(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to(device)`` for every tensor that has storage; meta tensors wait for their bucket."""
    return module._apply(lambda t: t if t.is_meta else t.to(device))


class Materializer:
    """Makes a parameter real: materialises and initialises the module that owns it, once.

    ``frozen_dtype``: frozen parameters are made in it (stage 3's compute dtype, all their bucket
    keeps), so that ``param_init`` writes them there directly: a bf16 base never exists in fp32,
    not even one module at a time (for a 32000 x 2048 embedding that is 262 MB against 131)."""

    def __init__(self, module: nn.Module, device: torch.device, param_init: ParamInit | None,
                 frozen_dtype: torch.dtype | None = None):
        self.module, self.device, self.frozen_dtype = module, device, frozen_dtype
        self.param_init = param_init or reset_parameters
        self._done: set[int] = set()

    def __call__(self, fqn: str) -> None:
        owner = self.module.get_submodule(fqn.rpartition(".")[0])
        if id(owner) in self._done:
            return
        self._done.add(id(owner))
        own = dict(owner.named_parameters(recurse=False))
        kept = {}  # parameters already real (tied to a module materialised before): untouched
        for n, p in own.items():
            dtype = self.frozen_dtype if self.frozen_dtype is not None and not p.requires_grad else p.dtype
            scratch = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=self.device),
                                   requires_grad=p.requires_grad)
            # Swap in place: the Parameter object (its param group, hooks) stays the same, and so do its
            # Python attributes, which swap_tensors would trade for scratch's
            attributes = dict(p.__dict__)
            torch.utils.swap_tensors(p, scratch)
            p.__dict__.update(attributes)
            if not scratch.is_meta:
                kept[n] = scratch  # now holds the bucket's view; p is scratch while param_init runs
        with torch.no_grad():
            self.param_init(owner)
        for n, view in kept.items():
            torch.utils.swap_tensors(own[n], view)
        still = [n for n, p in owner.named_parameters(recurse=False) if p.is_meta]
        if still:
            raise UsageError(f"param_init left {', '.join(still)} of module "
                             f"'{fqn.rpartition('.')[0] or '<root>'}' on the meta device")
