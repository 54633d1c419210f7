"""The one O_DIRECT block path: swap files (offload/nvme.py) and checkpoint datasets
(checkpoint/rawio.py) move their bytes through it.

O_DIRECT skips the page cache: no copy into it, no page bookkeeping, no writeback by the flusher,
and resident memory that does not grow with the data. It needs memory, file offset and length
aligned to the device's logical block (aligned.py's ``ALIGN``); a block whose memory is not is
staged through a bounded pool of aligned buffers. Some filesystems refuse O_DIRECT at open
(ramfs, older tmpfs), some accept the open and refuse the first I/O with EINVAL: both get
buffered I/O, the same bytes.

A positional read or write may move fewer bytes than asked, so ``transfer`` repeats it until
all is moved; a read that meets the end of the file raises the caller's error. Checksums are the
caller's (zerompi/checksum.py): ``move_block`` shows it each block in the memory the I/O used.
"""
from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from zerompi.blockio.aligned import ALIGN, BufferPool, round_up

WRITE, READ = "write", "read"
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

Transfer = Callable[[memoryview, int], None]
"""Moves all of a view at a file offset (``transfer`` bound to a descriptor and the caller's errors)."""


def open_direct(path: str | Path, flags: int, mode: int = 0o600) -> int | None:
    """``path`` opened with ``flags | O_DIRECT``; None where the system or the filesystem refuses it
    at open."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, flags | _O_DIRECT, mode)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        if flags & os.O_CREAT and flags & os.O_EXCL:
            os.unlink(path)  # Linux creates the file before refusing O_DIRECT; O_EXCL proves it is ours
        return None


def create(path: str, direct: bool, pool: BufferPool) -> tuple[int, bool]:
    """Create ``path`` exclusively (mode 0600) for reading and writing; returns (fd, whether O_DIRECT
    is on). O_DIRECT when ``direct`` and the filesystem takes it, at open and for one page written
    and read back through a buffer of ``pool``; else buffered."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
    fd = open_direct(path, flags) if direct else None
    if fd is not None:
        try:
            works = _direct_io_works(fd, pool)
        except BaseException:
            _discard(fd, path)
            raise
        if works:
            return fd, True
        _discard(fd, path)
    return os.open(path, flags, 0o600), False


def _direct_io_works(fd: int, pool: BufferPool) -> bool:
    """Whether one page goes through ``fd`` (some filesystems accept an O_DIRECT open but refuse the I/O)."""
    with pool.lease() as buf:
        try:
            os.pwritev(fd, [buf.view[:ALIGN]], 0)
            os.preadv(fd, [buf.view[:ALIGN]], 0)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return False
        finally:
            os.ftruncate(fd, 0)
    return True


def _discard(fd: int, path: str) -> None:
    """Close and delete a file just created (an error here is not the one to report)."""
    for action in (lambda: os.close(fd), lambda: os.unlink(path)):
        try:
            action()
        except OSError:
            pass


def transfer(kind: str, fd: int, view: memoryview, offset: int,
             short: Callable[[int], BaseException] | None = None,
             failed: Callable[[int, OSError], BaseException] | None = None) -> None:
    """Move all of ``view`` to (``WRITE``) or from (``READ``) file offset ``offset`` of ``fd``.

    A call that moves nothing (a read at the end of the file) raises ``short(done)``; an OSError
    raises ``failed(done, error)`` from it. ``done`` is how many bytes had moved. Without them, an
    OSError propagates and no progress is an EIO."""
    io = os.pwritev if kind == WRITE else os.preadv
    done = 0
    while done < len(view):
        try:
            n = io(fd, [view[done:]], offset + done)
        except OSError as e:
            if failed is None:
                raise
            raise failed(done, e) from e
        if n == 0:
            if short is None:
                raise OSError(errno.EIO, f"{kind} moved nothing at file offset {offset + done}")
            raise short(done)
        done += n


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


def page_aligned(view: memoryview, offset: int) -> bool:
    """Whether O_DIRECT can move ``view`` at ``offset`` as it is: memory, offset and length aligned."""
    return offset % ALIGN == 0 and len(view) % ALIGN == 0 and _address(view) % ALIGN == 0


def move_block(kind: str, mem: memoryview, offset: int, pool: BufferPool, io: Transfer,
               seen: Callable[[memoryview], None] | None = None) -> bool:
    """Move one block, the bytes of ``mem``, to or from file offset ``offset`` with ``io``; True when
    it was staged.

    Directly when memory, offset and length are page aligned; else through a buffer leased from
    ``pool``, the I/O rounded up to whole pages: the file must have room for that padding, and
    writes zero it so that the file's bytes do not depend on what the buffer held before.
    ``seen(payload)`` is shown the block's bytes in the memory the I/O used, before a write and
    after a read (where a read's checksum fails before anything is copied back)."""
    if page_aligned(mem, offset):
        if kind == WRITE and seen is not None:
            seen(mem)
        io(mem, offset)
        if kind == READ and seen is not None:
            seen(mem)
        return False
    n = len(mem)
    with pool.lease() as buf:
        view = buf.view[:round_up(n)]
        stage = np.frombuffer(view, np.uint8)
        if kind == WRITE:
            np.copyto(stage[:n], np.frombuffer(mem, np.uint8))
            stage[n:] = 0
            if seen is not None:
                seen(view[:n])
            io(view, offset)
        else:
            io(view, offset)
            if seen is not None:
                seen(view[:n])
            np.copyto(np.frombuffer(mem, np.uint8), stage[:n])
    return True


class PageWriter:
    """Writes to a file through its buffered descriptor ``fd`` (not owned), except whole pages at
    page-aligned offsets, which go through a second descriptor opened with O_DIRECT: straight from
    the memory when it is aligned, else staged through ``buffers`` buffers of ``nbytes``. Where the
    filesystem refuses O_DIRECT (at open, or with EINVAL at a write) every byte goes through ``fd``
    from then on. Safe to call from several threads."""

    def __init__(self, path: str | Path, fd: int, buffers: int, nbytes: int, direct: bool = True):
        self.fd = fd
        self._direct = open_direct(path, os.O_WRONLY | _O_CLOEXEC) if direct else None
        self._direct_ok = self._direct is not None  # False once a write refused O_DIRECT
        self._pool = BufferPool(buffers, nbytes) if self._direct is not None else None
        self._lock = threading.Lock()
        self.direct_bytes = 0
        """Bytes that went through O_DIRECT."""

    def write(self, mem: memoryview, at: int) -> None:
        """All of ``mem`` to file offset ``at``: its whole pages direct when ``at`` is page aligned,
        the rest (and everything, without O_DIRECT) through the page cache."""
        whole = len(mem) // ALIGN * ALIGN if self._direct_ok and at % ALIGN == 0 else 0
        if whole:
            try:
                move_block(WRITE, mem[:whole], at, self._pool, partial(transfer, WRITE, self._direct))
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct_ok, whole = False, 0  # accepted at open, refused at the write: buffered from here
            with self._lock:
                self.direct_bytes += whole
        if whole < len(mem):
            transfer(WRITE, self.fd, mem[whole:], at + whole)

    def close(self) -> None:
        """Close the O_DIRECT descriptor and free the staging buffers; idempotent."""
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
