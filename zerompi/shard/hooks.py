"""HookSet: turns autograd and module events into calls on the sharded model.

Three kinds of hooks, each a one-liner into the owner:

* per parameter, ``register_post_accumulate_grad_hook``: the gradient of this
  parameter is complete for this backward (fires once, after autograd has
  summed every use of the parameter);
* stage 3, per gather unit, forward pre-hook and forward hook: gather the
  unit's parameters before its forward and release them after;
* stage 3, on the unit's forward outputs, tensor hooks: the gradient of the
  output exists, so the unit's backward is next and needs its parameters;
* stage 3, on the unit's forward inputs, an identity autograd function whose
  backward runs once the gradients of its inputs exist: the unit's backward
  has run (FSDP2's post-backward), which frozen parameters, having no
  gradient hook, need to be released before the end of the whole backward.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from zerompi.torch_private import tree_flatten, tree_unflatten


class HookSet:
    """Holds every hook handle it installs; ``remove()`` undoes them all. While ``paused``, the forward hooks
    do nothing: forwards of a model whose parameters are all whole already (a framework's generation inside
    ``GatheredParameters``, which a rank may run more or fewer times than its peers) gather nothing."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self.paused = False

    def on_grad_ready(self, params: list[torch.nn.Parameter],
                      fn: Callable[[torch.nn.Parameter], None]) -> None:
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(fn))

    def around_forward(self, module: torch.nn.Module, before: Callable[[tuple, dict], Any],
                       after: Callable[[Any], None]) -> None:
        """``before(args, kwargs)`` may return replacement ``(args, kwargs)`` (or None)."""
        # prepend: our gather must run before any user pre-hook reads the weights
        self._handles.append(module.register_forward_pre_hook(
            lambda _m, args, kwargs: None if self.paused else before(args, kwargs), prepend=True, with_kwargs=True))
        self._handles.append(module.register_forward_hook(lambda _m, _args, out: None if self.paused else after(out)))

    @staticmethod
    def after_backward_of(args: tuple, kwargs: dict, fn: Callable[[], None]) -> tuple[tuple, dict] | None:
        """``(args, kwargs)`` whose tensors that require grad pass through an identity function calling
        ``fn`` in backward, once the gradients of all of them exist; None when none requires grad
        (then nothing tells when the module's backward is done)."""
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:
            return None
        for i, t in zip(at, _AfterBackward.apply(fn, *(leaves[i] for i in at))):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    @staticmethod
    def before_backward_of(output: Any, fn: Callable[[], None]) -> int:
        """Call ``fn`` when a gradient reaches any tensor of ``output``; returns how many hooks."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for t in tensors:
            t.register_hook(lambda _grad: fn())
        return len(tensors)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class _AfterBackward(torch.autograd.Function):
    """Identity on tensors; its backward calls ``fn`` before passing the gradients on."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        return tensors  # as they are (no copy), as FSDP2's post-backward function returns its inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)
