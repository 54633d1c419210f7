"""A whole-tensor optimizer's parameters: views of the master shard in the shapes of the tensors it owns.

Optimizers that look at a whole tensor (Muon's orthogonalisation, Adafactor's factored second moment)
cannot step a flat shard that cuts across tensors. Their groups' buckets are owner-aligned
(shard/layout.py's ``plan_owned_bucket``): every parameter lies whole in one rank's shard, so the
reduce-scatter already brings its owner the whole gradient, and the all-gather after the step hands
every rank the updated tensor. Here the owner's master shard is cut back into its tensors: the torch
optimizer steps views of the master with the parameters' shapes (every tensor at stage 0, where each
rank updates all), and its state lives only on the owner.

Checkpoints save each tensor's state whole, under the tensor's name (:meth:`TensorViews.tensor_states`,
checkpoint/tensors.py): per-element state (Muon's momentum) and state of another shape (Adafactor's
factored row and column statistics) alike, so that a load hands each tensor exactly its own state on
whichever rank owns it then. Only plain Python values (a step count kept as an int) travel with the
bucket, as every other bucket's scalars do. (Checkpoints written before kept per-element state packed
flat over the shard; :meth:`TensorViews.unpack` still reads those.)
"""
from __future__ import annotations

from typing import Any

import torch


class TensorViews:
    """For each bucket of a whole-tensor group, the views of its master shard that this rank steps."""

    def __init__(self, buckets):
        self.of: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        self.names: dict[int, list[str]] = {}  # each view's parameter name, in the same order
        for b in buckets:
            own, views, names = b.own, [], []
            for slot in b.layout.slots:
                a, z = slot.offset - own.start, slot.offset - own.start + slot.numel
                if slot.numel and 0 <= a and z <= own.numel:  # owner-aligned: whole inside, or outside
                    views.append((b.master[a:z].view(slot.shape), a, z))
                    names.append(slot.fqn)
            self.of[b.layout.index], self.names[b.layout.index] = views, names

    def params(self, index: int) -> list[torch.Tensor]:
        return [v for v, _, _ in self.of[index]]

    def set_grads(self, index: int, grad: torch.Tensor | None) -> None:
        """Each view's gradient from the bucket's flat gradient shard (None: clear them)."""
        for v, a, z in self.of[index]:
            v.grad = None if grad is None else grad[a:z].view(v.shape)

    def pack(self, index: int, state: dict) -> dict[str, Any]:
        """The bucket's optimizer state as a bucket's checkpoint datasets see it: the plain values of its
        tensors' states (the first tensor's: every tensor of a group steps together); tensors' state
        goes whole, per tensor (``tensor_states``)."""
        out: dict[str, Any] = {}
        for v, _, _ in self.of[index]:
            for k, value in state.get(v, {}).items():
                if not isinstance(value, torch.Tensor):
                    out.setdefault(k, value)
        return out

    def unpack(self, index: int, state: dict, saved: dict[str, Any]) -> None:
        """Overwrite each view's state from a bucket's saved state (``pack``'s form)."""
        for v, a, z in self.of[index]:
            state[v] = {k: (x[a:z].reshape(v.shape).to(v.device, copy=True) if x.dim() else x.clone())
                        if isinstance(x, torch.Tensor) else x for k, x in saved.items()}  # a step count each

    def tensor_states(self, index: int, state: dict) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
        """(parameter name, its offset in the shard, its state tensors) of each tensor of bucket ``index``
        this rank steps that has any (the live tensors)."""
        out = []
        for (v, a, _), name in zip(self.of[index], self.names[index]):
            mine = {k: x for k, x in state.get(v, {}).items() if isinstance(x, torch.Tensor)}
            if mine:
                out.append((name, a, mine))
        return out

    def load_tensor_state(self, index: int, state: dict, name: str, saved: dict[str, torch.Tensor]) -> None:
        """Add ``saved`` (``tensor_states``' form, read back) to the state of the tensor ``name``."""
        view = self.of[index][self.names[index].index(name)][0]
        state.setdefault(view, {}).update({k: x.to(view.device, copy=True) for k, x in saved.items()})
