"""What ``O_DIRECT`` needs of memory: buffers aligned to the device's block.

``O_DIRECT`` needs buffers, offsets and sizes aligned to the device's logical
block size; anonymous ``mmap`` memory is page aligned, which covers every
block size up to the page size, and ``ALIGN`` covers 512 B and 4 KiB blocks.

A bounded pool hands out reusable page-aligned buffers (the staging memory of
direct.py), each seen as a ``memoryview`` for ``os.preadv``/``os.pwritev``,
numpy copies (which release the GIL) and crc32. Buffers are created lazily,
at most ``count`` of them over the pool's life, and reused: resident memory
stays at or under ``count * nbytes`` however much data flows through, and a
caller that finds every buffer taken waits.

Tensors allocated here (``aligned_empty``, ``aligned_clone``) start on a 4 KiB
boundary, so their whole pages move with no staging copy; ``Reuse`` keeps the
memory of released ones for the next tensor of the same size.
"""
from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator

import torch

from zerompi import torch_private
from zerompi.errors import UsageError

ALIGN = 4096
"""Alignment of file offsets and I/O sizes."""


def round_up(n: int) -> int:
    """``n`` bytes rounded up to whole ``ALIGN`` pages."""
    return -(-n // ALIGN) * ALIGN


class AlignedBuffer:
    """``nbytes`` of page-aligned memory seen as a memoryview."""

    def __init__(self, nbytes: int):
        self._mmap = mmap.mmap(-1, nbytes)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap; the memoryview must not be used afterwards."""
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            # A slice still lives, e.g. in the traceback of an I/O error kept by
            # a Future; the memory is unmapped when the last reference goes.
            pass


class BufferPool:
    """At most ``count`` reusable :class:`AlignedBuffer` of ``nbytes`` each."""

    def __init__(self, count: int, nbytes: int):
        self.count = count
        self.nbytes = nbytes
        self._free: list[AlignedBuffer] = []
        self._created = 0
        self._slots = threading.BoundedSemaphore(count)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def created(self) -> int:
        """How many buffers exist (the pool's resident memory is ``created * nbytes``)."""
        return self._created

    @contextlib.contextmanager
    def lease(self) -> Iterator[AlignedBuffer]:
        """Borrow a buffer for the ``with`` block, waiting while all are in use."""
        self._slots.acquire()
        try:
            buf = self._take()
        except BaseException:
            self._slots.release()
            raise
        try:
            yield buf
        finally:
            with self._lock:
                self._free.append(buf)
            self._slots.release()

    def _take(self) -> AlignedBuffer:
        with self._lock:
            if self._closed:
                raise UsageError("BufferPool.lease() after close(); hint: close the pool last")
            if self._free:
                return self._free.pop()
        # The semaphore caps leases at ``count``, so an empty free list means
        # fewer than ``count`` buffers exist and one more may be made.
        buf = AlignedBuffer(self.nbytes)
        with self._lock:
            self._created += 1
        return buf

    def close(self) -> None:
        """Unmap every buffer. Call only when no lease is outstanding; idempotent."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for buf in free:
            buf.close()


class Reuse:
    """Host memory of released tensors, kept for the next tensor of the same size.

    Offload streams the same few shard sizes through memory unit after unit; each new block
    costs a page fault per 4 KiB page (glibc maps every large block afresh once its mmap
    threshold is fixed, memory.py's ``return_freed_memory``), which on this project's VM runs at
    about 1.7 GB/s against 7 GB/s for memory already mapped. ``release`` hands a tensor's storage
    here when nothing else holds it (torch's use count, where this torch exposes it);
    ``aligned_empty`` takes a block of the exact size when one is here. At most ``limit`` bytes
    wait, the oldest going first, so resident memory stays bounded whatever the model's size; the
    limit is 0 (no reuse) until its owner raises it (``keep``). Each NVMe swapper holds one
    (offload/nvme.py), handed to the tiers and buffers of its engine: there is no process-wide
    pool."""

    def __init__(self, limit: int = 0):
        self.limit = limit
        self._free: list[torch.UntypedStorage] = []  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        self._use_count = torch_private.use_count_of()

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].nbytes() == nbytes:
                    self._bytes -= nbytes
                    return self._free.pop(i)
        return None

    def give(self, storage: torch.UntypedStorage) -> None:
        """Keep ``storage`` if this is its last reference (a view, a transfer or a caller's copy
        still using it keeps it out)."""
        n = storage.nbytes()
        if self._use_count is None or not 0 < n <= self.limit or self._use_count(storage) != 1:
            return
        with self._lock:
            self._free.append(storage)
            self._bytes += n
            while self._bytes > self.limit:
                self._bytes -= self._free.pop(0).nbytes()

    @property
    def nbytes(self) -> int:
        """Bytes waiting for reuse."""
        return self._bytes

    def keep(self, nbytes: int) -> None:
        """Keep up to ``nbytes`` of released memory from now on (never less than already allowed)."""
        self.limit = max(self.limit, nbytes)


def aligned_empty(numel: int, dtype: torch.dtype, pool: Reuse | None = None) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on a 4 KiB boundary, in memory taken from
    ``pool`` when it holds a block of the size.

    The swapper moves such tensors' whole blocks without a staging copy.
    """
    item = torch.empty(0, dtype=dtype).element_size()
    nbytes = numel * item + ALIGN
    storage = pool.take(nbytes) if pool is not None else None
    if storage is None:
        storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    skip = -storage.data_ptr() % ALIGN  # a multiple of the allocator's 64-byte alignment: whole elements
    return torch.empty(0, dtype=dtype).set_(storage, skip // item, (numel,))  # not a view


def aligned_clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (flat) whose host memory starts on a 4 KiB boundary, so that checkpoints and
    swap files move it with O_DIRECT and no staging copy; a plain clone elsewhere (pinned memory
    and device tensors)."""
    if t.device.type != "cpu" or t.is_pinned():
        return t.clone()
    out = aligned_empty(t.numel(), t.dtype)
    out.copy_(t.reshape(-1))
    # set_, not view(): a view keeps its base, and the whole storage, alive through ``_base`` after
    # ``release`` has swapped its data for an empty tensor (a released swap-file shard would stay)
    if t.dim() == 1:
        return out
    return torch.empty(0, dtype=t.dtype).set_(out.untyped_storage(), out.storage_offset(), t.shape)


def align_storage(t: torch.Tensor) -> bool:
    """Move a host tensor that does not start on a 4 KiB boundary (optimizer state torch allocated)
    to memory that does, keeping the tensor object (optimizers key their state by it); whether it moved."""
    if t.device.type == "cpu" and t.numel() and t.data_ptr() % ALIGN and not t.is_pinned():
        t.data = aligned_clone(t.detach())
        return True
    return False


def release(t: torch.Tensor, pool: Reuse | None = None) -> None:
    """Swap ``t``'s data for an empty tensor: the object (an optimizer state key, a bucket's shard)
    survives, and the old storage goes once any finished transfer drops its view of it (at once to
    ``pool`` when nothing else holds it)."""
    storage = t.untyped_storage() if t.device.type == "cpu" and t.numel() and not t.is_pinned() else None
    t.data = t.new_empty(0)
    if storage is not None and pool is not None:
        pool.give(storage)


def allocate(t: torch.Tensor, numel: int, pool: Reuse | None = None) -> None:
    """Give a released ``t`` storage for ``numel`` elements again (from ``pool`` when it has a block
    of the size). Host memory is allocated on a 4 KiB boundary, so the swapper moves it with O_DIRECT
    and no staging copy (pinned memory is page aligned already)."""
    if t.numel() != numel:
        t.data = aligned_empty(numel, t.dtype, pool) if t.device.type == "cpu" and not t.is_pinned() \
            else t.new_empty(numel)
