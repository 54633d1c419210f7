"""The swap file's parts that do no I/O scheduling: its settings, its regions and statistics,
claiming disk space up front, removing the file, and the checks on a tensor handed to it."""
from __future__ import annotations

import errno
import heapq
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from zerompi.errors import ConfigError, ZeroMPIError
from zerompi.log import get_logger
from zerompi.blockio.aligned import ALIGN

logger = get_logger(__name__)

_MiB = 1 << 20


class SwapError(ZeroMPIError):
    """Swap file I/O failed, the file changed underneath us, or a key was misused."""


def _check_int(key: str, value: object, lo: int, hi: int, multiple: int = 1) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or not lo <= value <= hi or value % multiple:
        extra = f" and a multiple of {multiple}" if multiple > 1 else ""
        raise ConfigError(f"SwapConfig.{key}={value!r} is not an int in {lo}..{hi}{extra}")


@dataclass(frozen=True)
class SwapConfig:
    """How an :class:`NVMeSwapper` does its I/O."""

    block_bytes: int = 8 * _MiB
    """Bytes per I/O request; larger tensors are split into blocks that are in
    flight together. A multiple of 4096 in 4 KiB..256 MiB."""
    threads: int = 4
    """I/O threads, i.e. blocks in flight at once (also bounded by ``buffers``). 1..64."""
    buffers: int = 8
    """Staging buffers of ``block_bytes`` each, created on first use; staging
    memory never exceeds ``buffers * block_bytes``. At most ``threads`` are
    ever in use at once, so more than ``threads`` costs nothing. 1..1024."""
    direct: bool = True
    """Open the file with ``O_DIRECT`` (bypass the page cache); falls back to
    buffered I/O with one warning where the filesystem refuses it."""
    verify: bool = True
    """Record a crc32 per block at write and check it at read."""

    def __post_init__(self):
        _check_int("block_bytes", self.block_bytes, 4096, 256 * _MiB, ALIGN)
        _check_int("threads", self.threads, 1, 64)
        _check_int("buffers", self.buffers, 1, 1024)
        for key in ("direct", "verify"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"SwapConfig.{key}={getattr(self, key)!r} is not a bool (True or False)")


class Region(NamedTuple):
    """Where a key lives in the swap file: ``nbytes`` bytes from ``offset``."""
    offset: int
    nbytes: int


class SwapStats(NamedTuple):
    """Totals since the swapper was opened. Seconds are summed over I/O threads."""
    bytes_written: int
    bytes_read: int
    write_seconds: float
    read_seconds: float
    checksum_seconds: float
    staged_bytes: int
    """Bytes copied through staging buffers; the rest moved straight from or to
    tensors whose memory is 4 KiB aligned (see ``aligned_empty``)."""


def remove_file(fd: int, path: str) -> None:
    """Close and delete the swap file (once: a closed fd number may be reused)."""
    for action in (lambda: os.close(fd), lambda: os.unlink(path)):
        try:
            action()
        except OSError as e:
            if e.errno not in (errno.EBADF, errno.ENOENT):
                logger.warning("removing swap file %s: %s", path, e)


def claim_space(fd: int, directory: str, what: str, offset: int, size: int) -> None:
    """Allocate ``size`` bytes at ``offset`` now, so that a full disk fails at
    reserve() and not in the middle of a step. ``what`` names key and file."""
    if size == 0:
        return
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    # Filesystems without size accounting (ramfs, some FUSE) report 0 blocks in all.
    if st.f_blocks and size > free:
        raise SwapError(f"cannot reserve {size} bytes for {what}: only {free} bytes free on the "
                        f"filesystem of {directory!r}; hint: free space or point nvme_path at a larger disk")
    try:
        os.posix_fallocate(fd, offset, size)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise SwapError(f"cannot reserve {size} bytes at offset {offset} for {what}: {e.strerror}; "
                            f"hint: free space on {directory!r}") from e
        os.ftruncate(fd, offset + size)  # no fallocate here: a sparse file must do


def check_tensor(tensor: object, what: str, key: str, nbytes: int) -> None:
    """Check that ``tensor`` is a contiguous CPU tensor of exactly ``nbytes``."""
    if not isinstance(tensor, torch.Tensor):
        raise SwapError(f"{what} of key {key!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    problem = None
    if tensor.device.type != "cpu":
        problem = f"is on {tensor.device}; hint: move it to (pinned) CPU memory first"
    elif tensor.layout != torch.strided or not tensor.is_contiguous():
        problem = "is not a contiguous strided tensor; hint: swap a .contiguous() copy or a flat buffer"
    elif tensor.is_conj() or tensor.is_neg():
        problem = "is a lazy conj/neg view; hint: swap tensor.resolve_conj().resolve_neg()"
    elif tensor.numel() * tensor.element_size() != nbytes:
        got = tensor.numel() * tensor.element_size()
        problem = (f"has {got} bytes but the key's region holds {nbytes}; "
                   "hint: reserve a separate key for a tensor of another size")
    if problem:
        raise SwapError(f"{what} of key {key!r}: tensor {tuple(tensor.shape)} {tensor.dtype} {problem}")


class Priority:
    """Which swap transfers go first when several wait: what the compute thread is about to block
    on (a parameter shard read ahead), then what it needs a little later (optimizer state read
    ahead), then writes, which nothing waits for until the step ends."""

    URGENT, SOON, BEHIND = 0, 1, 2


class PriorityPool:
    """``threads`` worker threads running submitted calls, lowest ``priority`` first, then in
    submission order (a ThreadPoolExecutor is first-in first-out only)."""

    def __init__(self, threads: int, name: str):
        self._heap: list[tuple[int, int, Callable[[], None] | None]] = []
        self._seq = itertools.count()
        self._ready = threading.Condition()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn: Callable[[], None]) -> None:
        with self._ready:
            heapq.heappush(self._heap, (priority, next(self._seq), fn))
            self._ready.notify()

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._heap:
                    self._ready.wait()
                fn = heapq.heappop(self._heap)[2]
            if fn is None:  # shutdown: queued after everything else
                return
            fn()  # its errors are delivered through its own Future

    def shutdown(self) -> None:
        """Run what is queued, then stop the threads. Idempotent."""
        threads, self._threads = self._threads, []
        for _ in threads:
            self.submit(1 << 30, None)
        for t in threads:
            t.join()
