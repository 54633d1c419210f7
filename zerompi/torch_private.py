"""Every private torch API zerompi uses, in one place (tests/unit/test_torch_private.py pins each).

A torch upgrade that renames or changes one of these fails that test by name instead of
degrading quietly where it is used. Where torch lacks one, the public fallback is named here:

- ``_swap_data_ptr_`` moves bytes between two storage objects, so a freed FlatBuffer's memory can
  be kept and handed back to the same storage object (shard/buffer.py); without it buffers free
  to the C library (``resize_``);
- ``_storage_Use_Count`` tells whether a released storage has no other user, so its memory may be
  reused (blockio/aligned.py's Reuse); without it nothing is reused;
- ``torch.utils._pytree`` walks nested args and outputs (engine.py, shard/hooks.py); it has no
  public equivalent in torch 2.x, and torch's own compile and FSDP2 rely on it;
- an LR scheduler's first ``step()`` warns unless its optimizer's ``step`` carries
  ``_wrapped_by_lr_sched`` and set ``_opt_called``, which only the scheduler's constructor
  arranges: ``track_scheduler_steps`` does it for a scheduler moved onto another optimizer
  (compat/deepspeed/client.py); without it that first step warns, nothing else changes;
- ``_create_work_from_future`` turns a finished Future into the ``Work`` a process group written in
  Python returns (compat/deepspeed/torch_dist.py, the default group DeepSpeed scripts get); torch
  has no public constructor for it.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["can_move_storage", "create_work_from_future", "move_storage", "track_scheduler_steps", "use_count_of", "tree_flatten", "tree_map",
           "tree_unflatten"]


def can_move_storage() -> bool:
    """Whether this torch can move the bytes of one storage object into another."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def move_storage(dst: torch.UntypedStorage, src: torch.UntypedStorage) -> None:
    """Exchange the bytes of ``dst`` and ``src`` (each keeps its identity and its views)."""
    dst._swap_data_ptr_(src)


def use_count_of() -> Callable[[torch.UntypedStorage], int] | None:
    """A function giving a storage's reference count inside torch, or None where torch lacks it."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else (lambda storage: count(storage._cdata))


def track_scheduler_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as an LR scheduler's constructor does, so that a scheduler re-pointed at
    ``optimizer`` sees its steps (torch.optim.lr_scheduler.LRScheduler.__init__'s patch)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)  # as torch's patch: no reference cycle through the bound method
    func = optimizer.step.__func__

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        opt = owner()
        opt._opt_called = True
        return func.__get__(opt, opt.__class__)(*args, **kwargs)
    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def create_work_from_future(future):
    """torch.distributed's ``Work`` completed by ``future`` (c10d's private constructor)."""
    from torch._C._distributed_c10d import _create_work_from_future
    return _create_work_from_future(future)
