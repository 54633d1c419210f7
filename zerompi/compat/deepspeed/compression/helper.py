"""``deepspeed.compression.helper``: ``recursive_getattr`` and ``recursive_setattr``, a submodule by dotted name."""
from __future__ import annotations

from torch import nn

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: nn.Module, module_name: str):
    """The attribute ``module_name`` ("layers.0.attn.q_proj") of ``model``."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: nn.Module, module_name: str, module) -> None:
    """Set the attribute ``module_name`` of ``model`` to ``module`` (a LoRA layer in place of a Linear)."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)
