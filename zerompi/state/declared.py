"""What a component declares of the state a checkpoint keeps: a kind and the component that holds it.

The optimizer, the sharded model and the process each answer ``declared_state()`` with
:class:`Declared` values; checkpoint/entries.py turns each into the entry that writes and
reads that kind, through the holder's public methods (checkpoint/snapshot.py's protocols
say which). So optim/, shard/ and comm/ never import checkpoint/, and a new kind of state
is a new :class:`StateKind`, its entry in checkpoint/, and the holder that declares it.
This module imports nothing of zerompi.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

import torch

__all__ = ["Declared", "HeldResiduals", "StateKind"]


class StateKind(Enum):
    """The kinds of checkpointed state (each has one entry class in checkpoint/entries.py)."""

    OPTIMIZER_SHARDS = "optimizer shards"
    """Every bucket's fp32 master and per-element optimizer state (holder: snapshot.py's ShardStates)."""
    TENSOR_STATES = "tensor states"
    """The state of the optimizers that step whole tensors, per tensor (holder: ShardStates)."""
    FROZEN_SHARDS = "frozen shards"
    """Stage 3's frozen parameter shards (holder: snapshot.py's FrozenHolder)."""
    RESIDUALS = "error-feedback residuals"
    """The codecs' error-feedback residuals on this rank (holder: ``residuals() -> HeldResiduals``)."""
    PROCESS_RNG = "RNG state"
    """The process's CPU (and CUDA) generators (no holder: they are the process's)."""


class Declared(NamedTuple):
    """One kind of state a component holds, and the component (read and written through its methods)."""

    kind: StateKind
    holder: Any = None


HeldResiduals = tuple[tuple[int, torch.Tensor], ...]
"""(bucket index, this rank's error-feedback residual) of each bucket whose codec keeps one; live tensors."""
