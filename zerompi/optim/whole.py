"""A whole-tensor optimizer's parameters: views of the master shard in the shapes of the tensors it owns.

Optimizers that look at a whole tensor (Muon's orthogonalisation, Adafactor's factored second moment)
cannot step a flat shard that cuts across tensors. Their groups' buckets are owner-aligned
(shard/layout.py's ``plan_owned_bucket``): every parameter lies whole in one rank's shard, so the
reduce-scatter already brings its owner the whole gradient, and the all-gather after the step hands
every rank the updated tensor. Here the owner's master shard is cut back into its tensors: the torch
optimizer steps views of the master with the parameters' shapes (every tensor at stage 0, where each
rank updates all), and its state lives only on the owner.

Checkpoints see a bucket's state per element, as for any other bucket: the per-tensor states are packed
into flat tensors of the shard's length (zeros in the padding) and unpacked on load. State that is not
per element (Adafactor's row and column statistics) cannot be saved that way and is refused by name.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch


class NotPerElement(NamedTuple):
    """Optimizer state of another shape than its tensor (Adafactor's row and column statistics), which a
    bucket's flat state cannot hold: training reads past it, a checkpoint refuses it by name."""

    key: str
    shape: tuple[int, ...]
    tensor_shape: tuple[int, ...]

    def message(self) -> str:
        return (f"optimizer state {self.key!r} of shape {list(self.shape)} belongs to a tensor of shape "
                f"{list(self.tensor_shape)}: state that is not per element (a factored second moment) "
                "cannot be saved in a checkpoint yet")


class TensorViews:
    """For each bucket of a whole-tensor group, the views of its master shard that this rank steps."""

    def __init__(self, buckets):
        self.of: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        for b in buckets:
            own, views = b.own, []
            for slot in b.layout.slots:
                a, z = slot.offset - own.start, slot.offset - own.start + slot.numel
                if slot.numel and 0 <= a and z <= own.numel:  # owner-aligned: whole inside, or outside
                    views.append((b.master[a:z].view(slot.shape), a, z))
            self.of[b.layout.index] = views

    def params(self, index: int) -> list[torch.Tensor]:
        return [v for v, _, _ in self.of[index]]

    def set_grads(self, index: int, grad: torch.Tensor | None) -> None:
        """Each view's gradient from the bucket's flat gradient shard (None: clear them)."""
        for v, a, z in self.of[index]:
            v.grad = None if grad is None else grad[a:z].view(v.shape)

    def pack(self, index: int, state: dict, numel: int, device) -> dict[str, Any]:
        """The bucket's optimizer state as a checkpoint sees it: per-element tensors flat over the shard,
        scalars as the first tensor's (every tensor of a group steps together)."""
        out: dict[str, Any] = {}
        for v, a, z in self.of[index]:
            for k, value in state.get(v, {}).items():
                if isinstance(value, torch.Tensor) and value.dim():
                    if value.shape != v.shape:  # a checkpoint refuses it, naming it (NotPerElement)
                        out[k] = NotPerElement(k, tuple(value.shape), tuple(v.shape))
                        continue
                    flat = out.setdefault(k, torch.zeros(numel, dtype=value.dtype, device=device))
                    flat[a:z] = value.reshape(-1)
                else:
                    out.setdefault(k, value)
        return out

    def unpack(self, index: int, state: dict, saved: dict[str, Any]) -> None:
        """Overwrite each view's state from a bucket's saved state (``pack``'s form)."""
        for v, a, z in self.of[index]:
            state[v] = {k: (x[a:z].reshape(v.shape).to(v.device, copy=True) if x.dim() else x.clone())
                        if isinstance(x, torch.Tensor) else x for k, x in saved.items()}  # a step count each
