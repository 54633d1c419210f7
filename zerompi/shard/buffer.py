"""FlatBuffer: one contiguous 1-D tensor whose storage can be freed and re-allocated.

Parameters are bound as views into a FlatBuffer. Freeing resizes the
underlying storage to zero bytes instead of dropping the tensor, so the views
(and the ``nn.Parameter`` objects that hold them, and autograd's saved
tensors) stay valid objects and see the data again once it is re-allocated
and refilled. This is how stage 3 releases gathered parameters between uses (the
``nn.Parameter`` objects themselves are bound to a NaN stand-in meanwhile: shard/bucket.py).

Handed a ``reuse`` pool (host buffers only), a freed buffer's memory goes there
instead of back to the C library, and ``alloc`` takes memory of the same size
from it: the storage object keeps its identity (torch_private.move_storage moves the
bytes between storage objects, as ``resize_`` would have replaced them), so
the views see the reused memory. A unit's gathered parameters and gradient
buffer are the same size unit after unit, and memory already mapped is written
at several times the speed of a fresh mapping (see blockio/aligned.py's Reuse).
"""
from __future__ import annotations

import torch

from zerompi import torch_private
from zerompi.errors import ZeroMPIError


def _host_pool(reuse, device: torch.device):
    """``reuse`` (a pool with take(nbytes) -> storage | None and give(storage)) for host memory
    on a torch that can move bytes between storages; None elsewhere (a device allocator caches)."""
    return reuse if device.type == "cpu" and torch_private.can_move_storage() else None


class FlatBuffer:
    """A flat tensor of ``numel`` elements of ``dtype`` that can be freed and re-allocated."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 *, allocated: bool = True, zero: bool = False, reuse=None):
        self.numel = numel
        self.dtype = dtype
        self._reuse = _host_pool(reuse, torch.device(device))
        self.tensor = (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
        self._nbytes = self.tensor.untyped_storage().nbytes()
        if not allocated:
            self.free()

    @classmethod
    def holding(cls, tensor: torch.Tensor, *, reuse=None) -> "FlatBuffer":
        """A buffer over ``tensor``'s own storage (1-D, the whole of it), which it takes over: no copy."""
        if tensor.dim() != 1 or tensor.storage_offset() or \
                tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            raise ZeroMPIError("FlatBuffer.holding: the tensor must be 1-D and the whole of its storage")
        buf = cls.__new__(cls)
        buf.numel, buf.dtype, buf.tensor = tensor.numel(), tensor.dtype, tensor
        buf._reuse = _host_pool(reuse, tensor.device)
        buf._nbytes = tensor.untyped_storage().nbytes()
        return buf

    @property
    def is_allocated(self) -> bool:
        return self.tensor.untyped_storage().nbytes() > 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def alloc(self, *, zero: bool = False) -> torch.Tensor:
        """Give the storage its bytes back (contents undefined unless ``zero``)."""
        if not self.is_allocated:
            storage = self.tensor.untyped_storage()
            spare = self._reuse.take(self._nbytes) if self._reuse is not None else None
            if spare is not None:
                torch_private.move_storage(storage, spare)  # ``spare`` is left empty and dropped
            else:
                storage.resize_(self._nbytes)
            if zero:
                self.tensor.zero_()
        elif zero:
            raise ZeroMPIError("FlatBuffer.alloc(zero=True) on a buffer that is already allocated")
        return self.tensor

    def free(self) -> None:
        """Release the storage; views keep their shape and offset."""
        storage = self.tensor.untyped_storage()
        if self._reuse is not None and storage.nbytes():
            spare = torch.UntypedStorage(0)
            torch_private.move_storage(storage, spare)  # the bytes move to ``spare``; this one is left empty
            self._reuse.give(spare)         # kept for the next buffer of the size, or freed
        else:
            storage.resize_(0)

    def view(self, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of ``prod(shape)`` elements starting at ``offset``."""
        numel = 1
        for d in shape:
            numel *= d
        if offset < 0 or offset + numel > self.numel:
            raise ZeroMPIError(f"FlatBuffer.view: [{offset}, {offset + numel}) outside [0, {self.numel})")
        return self.tensor[offset:offset + numel].view(shape)
