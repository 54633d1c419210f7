"""NVMeSwapper: asynchronous per-rank file I/O for flat CPU tensors.

Each rank owns one swap file. A tensor is stored under a key in a fixed
region reserved once (``reserve``); ``write`` and ``read`` move its bytes in
``block_bytes`` blocks on a thread pool and return a ``Future``. Each block
goes through blockio/direct.py, the O_DIRECT path checkpoints use too: blocks
pass through a bounded pool of page-aligned buffers, because ``O_DIRECT`` needs
aligned memory and because resident memory must not grow with the data:
however many and however large the tensors, at most ``buffers * block_bytes``
bytes of staging memory exist, and blocks wait for a free buffer. Tensors
whose memory is already 4 KiB aligned (pinned host memory, ``aligned_empty``)
skip the staging copy for every whole block.

``os.pwritev``/``os.preadv``, crc32 (zlib-ng's when installed, else zlib's)
and numpy copies all release the GIL, so several blocks are in flight at once.

The caller must keep a tensor alive and must neither modify (write) nor read
(read) it until its Future completes; the Future completes only after every
block has finished, also when one of them failed.

The file is removed by ``close()``, when a ``with`` block exits (also through
an exception), when the swapper is garbage collected, and at interpreter exit.
A process killed by a signal (SIGKILL, or SIGTERM without a handler) leaves
it behind; its name carries rank and pid so that it can be identified.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from functools import partial

import torch

from zerompi.blockio import direct
from zerompi.blockio.aligned import BufferPool, Reuse, round_up
from zerompi.blockio.direct import READ as _READ
from zerompi.blockio.direct import WRITE as _WRITE
from zerompi.errors import ConfigError, UsageError
from zerompi.log import get_logger
from zerompi.offload.swapfile import (Priority, PriorityPool, Region, SwapConfig, SwapError, SwapStats,
                                      check_tensor, claim_space, remove_file)

__all__ = ["NVMeSwapper", "Priority", "Region", "SwapConfig", "SwapError", "SwapStats"]

from zerompi.checksum import crc32 as _crc32  # zlib-ng's when installed

logger = get_logger(__name__)

_file_seq = itertools.count()


@dataclass
class _Entry:
    region: Region
    dtype: torch.dtype | None = None  # None until a write of this key has succeeded
    crcs: list[int] = field(default_factory=list)


class _Op:
    """One write or read of a key; its blocks complete into one Future."""

    def __init__(self, kind: str, key: str, region: Region, tensor: torch.Tensor, block: int):
        self.kind, self.key, self.region, self.block = kind, key, region, block
        self.dtype = tensor.dtype
        self.result = tensor if kind == _READ else None
        # Holding the view also keeps the caller's storage alive until the I/O is done.
        self.data = tensor.detach().reshape(-1).view(torch.uint8)
        self.mem = memoryview(self.data.numpy())
        self.nblocks = -(-region.nbytes // block)
        self.crcs = [0] * self.nblocks
        self.error: BaseException | None = None
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()  # a started transfer cannot be cancelled
        self._left = self.nblocks
        self._lock = threading.Lock()

    def geometry(self, index: int) -> tuple[int, int]:
        """(start within the key, payload bytes) of a block."""
        start = index * self.block
        return start, min(self.block, self.region.nbytes - start)

    def block_done(self, error: BaseException | None) -> bool:
        """Record one finished block; True for the last one."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            return self._left == 0


class NVMeSwapper:
    """Asynchronous per-rank file I/O for flat tensors; returns Futures.

    ``directory`` must exist and be writable; the swap file is
    ``zerompi-swap-rank{rank}-{pid}-{n}.bin`` in it. Submit from one thread
    (or several: submission is locked); results arrive on I/O threads.
    """

    def __init__(self, directory: str | os.PathLike, rank: int, config: SwapConfig = SwapConfig()):
        if not isinstance(config, SwapConfig):
            raise ConfigError(f"NVMeSwapper config: expected a SwapConfig, got {type(config).__name__}")
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise SwapError(f"rank {rank}: swap directory {directory!r} does not exist or is not a "
                            "directory; hint: create it or point nvme_path at a local disk")
        self.config = config
        self.directory = directory
        self.path = os.path.join(directory, f"zerompi-swap-rank{rank}-{os.getpid()}-{next(_file_seq)}.bin")
        self._pool = BufferPool(config.buffers, config.block_bytes)
        self.memory = Reuse()
        """Host memory of this swapper's released shards, kept for the next of their size (its
        engine sets the limit once its buckets are built)."""
        self._fd, self.direct = self._open()
        self._finalizer = weakref.finalize(self, remove_file, self._fd, self.path)
        self._executor = PriorityPool(config.threads, f"zerompi-swap{rank}")
        weakref.finalize(self, self._executor.shutdown)  # idle threads of a swapper never closed
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._busy: dict[str, list[_Op]] = {}
        self._end = 0
        self._totals = [0, 0, 0.0, 0.0, 0.0, 0]  # the fields of SwapStats
        self._failed: list[BaseException] = []  # errors not yet raised by wait_all()
        self._closed = False
        logger.debug("opened swap file %s (O_DIRECT %s, %s)", self.path, self.direct, config)

    def _open(self) -> tuple[int, bool]:
        try:
            fd, is_direct = direct.create(self.path, self.config.direct, self._pool)
        except OSError as e:
            raise SwapError(f"cannot create swap file {self.path!r}: {e.strerror} (errno {e.errno}); "
                            "hint: the directory must be writable by this process") from e
        if self.config.direct and not is_direct:
            warnings.warn(f"the filesystem of {self.directory!r} refuses O_DIRECT; swapping through "
                          "the page cache instead, which is slower and uses host memory",
                          RuntimeWarning, stacklevel=3)
        return fd, is_direct

    # -- public API -----------------------------------------------------------------

    def fileno(self) -> int:
        """The swap file's descriptor (for inspection; do not do I/O on it)."""
        return self._fd

    @property
    def stats(self) -> SwapStats:
        """Bytes moved to and from the file (including padding to 4 KiB) and time spent."""
        with self._lock:
            return SwapStats(*self._totals)

    @property
    def reserved_bytes(self) -> int:
        """Size of the file: every region, each rounded up to 4 KiB."""
        return self._end

    def region(self, key: str) -> Region:
        """The region of a reserved key."""
        with self._lock:
            return self._entry(key, "region").region

    def reserve(self, key: str, nbytes: int) -> Region:
        """Give ``key`` a fixed region of ``nbytes`` and allocate its disk space now.

        Reserving an existing key again with the same size returns its region.
        Raises SwapError when the filesystem has not enough free space.
        """
        if not isinstance(key, str) or not key:
            raise SwapError(f"reserve: key must be a non-empty str, got {key!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise SwapError(f"reserve of key {key!r}: nbytes must be an int >= 0, got {nbytes!r}")
        with self._lock:
            self._check_open("reserve")
            entry = self._entries.get(key)
            if entry is not None:
                if entry.region.nbytes != nbytes:
                    raise SwapError(f"reserve of key {key!r}: already reserved with {entry.region.nbytes} "
                                    f"bytes, asked for {nbytes}; hint: use a new key for a new size")
                return entry.region
            size = round_up(nbytes)
            claim_space(self._fd, self.directory, f"key {key!r} in {self.path}", self._end, size)
            region = Region(self._end, nbytes)
            self._end += size
            self._entries[key] = _Entry(region)
        return region

    def write(self, key: str, tensor: torch.Tensor, priority: int = Priority.URGENT) -> Future:
        """Start copying a contiguous CPU tensor into ``key``'s region.

        The Future's result is None. Keep ``tensor`` unchanged until it is done. Blocks of
        transfers with a lower ``priority`` (:class:`Priority`) start first.
        """
        return self._submit(_WRITE, key, tensor, priority)

    def read(self, key: str, out: torch.Tensor, priority: int = Priority.URGENT) -> Future:
        """Start filling ``out`` (same dtype and size as written) from ``key``.

        The Future's result is ``out``. Do not use ``out`` until it is done.
        """
        return self._submit(_READ, key, out, priority)

    def wait_all(self) -> None:
        """Wait for every outstanding write and read.

        Then raise the first error of any transfer that failed since the last
        ``wait_all()``, whether or not its Future was already looked at, so
        that a caller that only calls ``wait_all()`` never misses a failure.
        """
        with self._lock:
            ops = [op for ops in self._busy.values() for op in ops]
        wait_futures([op.future for op in ops])
        with self._lock:
            failed, self._failed = self._failed, []
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Wait for outstanding I/O, stop the threads, and delete the file. Idempotent.

        Errors of outstanding transfers stay with their Futures.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ops = [op for ops in self._busy.values() for op in ops]
        wait_futures([op.future for op in ops])
        self._executor.shutdown()
        self._pool.close()
        self._finalizer()
        logger.debug("closed and removed swap file %s (%s)", self.path, self.stats)

    def __enter__(self) -> NVMeSwapper:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- submission -----------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise UsageError(f"NVMeSwapper.{what}() after close() of {self.path}")

    def _entry(self, key: str, what: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise SwapError(f"{what} of key {key!r}: the key is not reserved in {self.path}; "
                            "hint: call reserve(key, nbytes) first")
        return entry

    def _submit(self, kind: str, key: str, tensor: torch.Tensor, priority: int) -> Future:
        with self._lock:
            self._check_open(kind)
            entry = self._entry(key, kind)
            check_tensor(tensor, kind, key, entry.region.nbytes)
            self._check_conflicts(kind, key, entry, tensor)
            op = _Op(kind, key, entry.region, tensor, self.config.block_bytes)
            if kind == _READ:
                op.crcs = entry.crcs
            if op.nblocks == 0:  # an empty tensor: nothing to move
                if kind == _WRITE:
                    entry.dtype = tensor.dtype
                op.future.set_result(op.result)
                return op.future
            self._busy.setdefault(key, []).append(op)
            for index in range(op.nblocks):
                self._executor.submit(priority, lambda op=op, index=index: self._run_block(op, index))
        return op.future

    def _check_conflicts(self, kind: str, key: str, entry: _Entry, tensor: torch.Tensor) -> None:
        busy = self._busy.get(key, ())
        if any(op.kind == _WRITE for op in busy) or (kind == _WRITE and busy):
            raise UsageError(f"{kind} of key {key!r} while a {busy[0].kind} of it is in flight; "
                             "hint: wait on that Future first")
        if kind == _READ and entry.dtype is None:
            raise SwapError(f"read of key {key!r} from {self.path}: the key was never written "
                            "(or its last write failed); hint: write it before reading it")
        if kind == _READ and entry.dtype != tensor.dtype:
            raise SwapError(f"read of key {key!r}: written as {entry.dtype}, read into {tensor.dtype}; "
                            "hint: read into a tensor of the written dtype")

    # -- I/O threads ----------------------------------------------------------------

    def _run_block(self, op: _Op, index: int) -> None:
        error = None
        if op.error is None:  # after a failure, skip the remaining blocks
            try:
                start, n = op.geometry(index)
                staged = direct.move_block(op.kind, op.mem[start:start + n], op.region.offset + start, self._pool,
                                           partial(self._transfer, op), partial(self._check, op, index))
                if staged:
                    with self._lock:
                        self._totals[5] += n
            except BaseException as e:  # delivered through the Future
                error = e
        if op.block_done(error):
            self._finish(op)

    def _check(self, op: _Op, index: int, view: memoryview) -> None:
        """A block's checksum: recorded before it is written, compared after it is read."""
        if not self.config.verify:
            return
        if op.kind == _WRITE:
            op.crcs[index] = self._crc(view)
        elif self._crc(view) != op.crcs[index]:
            start, n = op.geometry(index)
            raise SwapError(f"checksum mismatch in {self.path}, key {op.key!r}, block of {n} bytes at "
                            f"file offset {op.region.offset + start}: the swap file changed underneath "
                            "us; hint: another process or a failing disk modified it")

    def _crc(self, view: memoryview) -> int:
        t0 = time.perf_counter()
        crc = _crc32(view)
        with self._lock:
            self._totals[4] += time.perf_counter() - t0
        return crc

    def _transfer(self, op: _Op, view: memoryview, offset: int) -> None:
        """Move all of ``view`` at file offset ``offset``; SwapError on failure or EOF."""
        moved = len(view)  # less when the transfer stops early

        def short(done: int) -> SwapError:
            nonlocal moved
            moved = done
            return SwapError(f"short {op.kind} on {self.path}, key {op.key!r}, at file offset "
                             f"{offset + done}: {done} of {len(view)} bytes from offset {offset}; "
                             "hint: the swap file was truncated or replaced by another process")

        def failed(done: int, e: OSError) -> SwapError:
            nonlocal moved
            moved = done
            return SwapError(f"{op.kind} failed on {self.path}, key {op.key!r}, {len(view)} bytes at file "
                             f"offset {offset + done}: {e.strerror} (errno {e.errno})")
        t0 = time.perf_counter()
        try:
            direct.transfer(op.kind, self._fd, view, offset, short, failed)
        finally:
            slot = 0 if op.kind == _WRITE else 1
            with self._lock:
                self._totals[slot] += moved
                self._totals[slot + 2] += time.perf_counter() - t0

    def _finish(self, op: _Op) -> None:
        with self._lock:
            busy = self._busy[op.key]
            busy.remove(op)
            if not busy:
                del self._busy[op.key]
            if op.error is not None:
                self._failed.append(op.error)
            if op.kind == _WRITE:
                # A failed write leaves the region half old, half new: unreadable.
                entry = self._entries[op.key]
                entry.dtype = op.dtype if op.error is None else None
                entry.crcs = op.crcs if op.error is None else []
        if op.error is not None:
            op.future.set_exception(op.error)
        else:
            op.future.set_result(op.result)
