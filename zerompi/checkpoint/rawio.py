"""Checkpoint data at the speed of the disk: HDF5 for the structure, pwrite/preadv for the bytes.

Writing (:class:`DataFile`): h5py creates the file, its groups and each dataset, and keeps its
attributes; a dataset of ``SMALL`` bytes or more is created contiguous with its storage allocated
at once and no fill value written, and its bytes go to ``ds.id.get_offset()`` through h5py's own
file descriptor with ``os.pwrite``, one checksum block per request (``schema.CRC_BLOCK`` elements:
4 MiB of fp32), on ``threads`` threads. Each block's CRC-32 is computed from memory just before it
is written: one pass over the data, and no re-read (a re-read right after writing is served by the
page cache and proves only what the cache holds). The file is plain HDF5: every reader sees the
same datasets, checksums and attributes as before.

Direct I/O (``checkpoint_direct_io``, default on): the whole 4 KiB pages of each block go through
a second descriptor opened with ``O_DIRECT``, from page-aligned memory (the data itself when it
is aligned, else a bounded pool of staging buffers), and only a block's ragged tail through the
page cache. A buffered write costs a copy into the page cache, the kernel's page bookkeeping and
the flusher's writeback, about 1.4 s of CPU per GB here against 0.25 s for a staged direct
write: on a machine whose cores train, that CPU is what an asynchronous save takes from the
steps. A filesystem that refuses ``O_DIRECT`` (ramfs; at open or at the first write) gets
buffered writes, the same bytes. The fsync at close still makes everything durable. The pages,
the staging and the fallback are blockio/direct.py's, which swap files use too.

Alignment (``checkpoint_align_kib``, default 1 MiB): every object of that many bytes or more
starts on a multiple of it in the file (HDF5's H5Pset_alignment), so the large datasets begin on
stripe boundaries. On Lustre set it to the stripe size (``lfs getstripe``: 1 MiB by default), on
GPFS to the file system's block size; the requests (4 MiB of fp32) are whole multiples of any
power-of-two stripe up to 4 MiB. A local disk needs nothing above 4 KiB, and the gaps alignment
leaves are holes that take no space.

Reading (:func:`read_into`): a contiguous dataset's blocks are read with ``os.preadv`` straight
into the caller's array and each block is checked from that memory; a block only partly wanted
(resharding at another world size) is read whole into a scratch block to check it. Other storage
goes through h5py (schema.read_array).

Verification on demand (``checkpoint_verify=True``): after the fsync the file's pages are dropped
from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``; clean pages only, hence after fsync)
and every dataset is read back and checked, so the check reads what reached the disk.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from zerompi.blockio.direct import READ, PageWriter, transfer
from zerompi.checkpoint import schema
from zerompi.checkpoint.durable import fsync_path, verify_file
from zerompi.config.sections import CheckpointPolicy
from zerompi.errors import CheckpointError

SMALL = 64 << 10  # bytes: smaller datasets are written through h5py
STAGE = schema.CRC_BLOCK * 8  # bytes: a staging buffer holds one checksum block of any element size


class WriteOptions(NamedTuple):
    """How a checkpoint's files are written (from the config's checkpointing policy)."""

    align: int = 1 << 20   # bytes: objects at least this large start on a multiple of it
    verify: bool = False   # drop the written file from the page cache and read every checksum back
    threads: int = 2       # blocks in flight per file (1: all on the caller's thread)
    direct: bool = True    # whole pages through O_DIRECT where the filesystem allows it

    @classmethod
    def from_policy(cls, policy: CheckpointPolicy) -> "WriteOptions":
        return cls(align=policy.align_kib * 1024, verify=policy.verify, direct=policy.direct_io)


def _blocks(start: int, stop: int) -> range:
    """The checksum blocks that elements ``[start, stop)`` touch (``stop > start``)."""
    return range(start // schema.CRC_BLOCK, (stop - 1) // schema.CRC_BLOCK + 1)


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pools_lock:
        return _pools.get(threads) or _pools.setdefault(threads, ThreadPoolExecutor(threads, "zerompi-ckpt-io"))


def _run(threads: int, tasks: list) -> list:
    """Call every task (a zero-argument function) on up to ``threads`` threads; results in order.
    Every task has ended when this returns or raises (the first failure, in task order): the
    caller may close the files they use. The threads are made once per process and shared (a
    save's thread and the caller's never nest)."""
    if threads <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    futures = [_pool(threads).submit(t) for t in tasks]
    wait(futures)
    return [f.result() for f in futures]


class DataFile:
    """An HDF5 file being written: h5py for its structure, ``os.pwrite`` for its large datasets."""

    def __init__(self, path: Path, options: WriteOptions = WriteOptions()):
        self.path, self.options = Path(path), options
        try:
            self.h5 = h5py.File(self.path, "w", alignment_threshold=options.align, alignment_interval=options.align)
        except TypeError:  # an h5py without the alignment keywords (before 3.7): unaligned, still correct
            self.h5 = h5py.File(self.path, "w")
        self.fd = self.h5.id.get_vfd_handle() if self.h5.driver == "sec2" else None
        self._pages = PageWriter(self.path, self.fd, max(options.threads, 1), STAGE, options.direct) \
            if self.fd is not None else None

    @property
    def direct_bytes(self) -> int:
        """Bytes that went through O_DIRECT (tests, benchmarks)."""
        return self._pages.direct_bytes if self._pages is not None else 0

    def put(self, name: str, data: np.ndarray, binding: schema.Binding | None = None) -> None:
        """Dataset ``name`` (1-D) with its checksums (bound to the file's header, written first,
        unless ``binding``: a node file holds datasets of several writing ranks)."""
        flat = np.ascontiguousarray(data).reshape(-1)
        if flat.nbytes < SMALL or self.fd is None:
            schema.write_array(self.h5, name, flat, binding)
            return
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # the offset exists now; HDF5 writes no data there
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        ds = self.h5.create_dataset(name, shape=flat.shape, dtype=flat.dtype, dcpl=dcpl)
        binding, offset = binding or schema.bound_to(self.h5, ds.name), ds.id.get_offset()
        raw = flat.view(np.uint8)
        step = schema.CRC_BLOCK * flat.itemsize

        def block(b: int) -> int:
            crc = schema.block_crc(flat[b * schema.CRC_BLOCK:(b + 1) * schema.CRC_BLOCK], binding, b)
            self._pages.write(memoryview(raw[b * step:(b + 1) * step]), offset + b * step)
            return crc
        crcs = _run(self.options.threads, [lambda b=b: block(b) for b in _blocks(0, flat.shape[0])])
        ds.attrs["crc32"] = np.asarray(crcs, dtype=np.uint32)

    def close(self) -> None:
        """Close the file (HDF5 writes its metadata), fsync it, and verify it when asked."""
        self._close_direct()
        self.h5.close()
        fsync_path(self.path, evict=self.options.verify)  # evicted: the re-read comes from the disk
        if self.options.verify:
            verify_file(self.path)

    def _close_direct(self) -> None:
        if self._pages is not None:
            self._pages.close()

    def abandon(self) -> None:
        """Close without the fsync, after a failure (the file is in a save's temporary directory)."""
        self._close_direct()
        try:
            self.h5.close()
        except Exception:  # noqa: BLE001 - the original failure is what the caller reports
            pass


READ_THREADS = 4  # blocks in flight while a load reads: enough to keep a disk's queue full


def read_into(arr: schema.Array, start: int, stop: int, out: np.ndarray, threads: int = 2) -> None:
    """Elements ``[start, stop)`` of ``arr`` into ``out`` (as many elements, of the dataset's own
    type), every block they touch checked against its checksum."""
    _run(threads, read_tasks(arr, start, stop, out))


class Reads:
    """Reads started as they are planned, on ``threads`` shared threads, so that opening and checking
    the next datasets overlaps the reading of the previous ones. ``wait()`` returns once every read
    has ended, raising the first failure: only then may the files be closed."""

    def __init__(self, threads: int = READ_THREADS):
        self._pool, self._futures = _pool(threads), []

    def add(self, tasks: list) -> None:
        self._futures += [self._pool.submit(t) for t in tasks]

    def wait(self) -> None:
        wait(self._futures)
        for f in self._futures:
            f.result()


def read_tasks(arr: schema.Array, start: int, stop: int, out: np.ndarray) -> list:
    """``read_into``'s reads as tasks to run later (:class:`Reads`), so that a load keeps the blocks of
    every dataset in flight at once: ``arr``'s file must stay open until they have run. Storage that
    is not one contiguous run of the file is read (through h5py) now, and gives no task."""
    if not isinstance(arr, schema.Array):  # a recovery point's array in memory (held.py)
        out[...] = arr.read(start, stop)
        return []
    ds, n = arr.ds, arr.length
    if not 0 <= start <= stop <= n:
        raise CheckpointError(f"{arr.where}: range [{start}, {stop}) outside [0, {n})")
    offset = ds.id.get_offset() if ds.file.driver == "sec2" else None
    if offset is None or out.dtype != arr.dtype or not out.flags.c_contiguous or stop == start:
        out[...] = schema.read_array(arr, start, stop)
        return []
    fd, item = ds.file.id.get_vfd_handle(), arr.dtype.itemsize
    size = os.fstat(fd).st_size  # for the message: a read at the end of the file moves nothing
    base = offset + arr.offset * item

    def block(b: int) -> None:
        lo, hi = b * schema.CRC_BLOCK, min(n, (b + 1) * schema.CRC_BLOCK)
        whole = start <= lo and hi <= stop
        dest = out[lo - start:hi - start] if whole else np.empty(hi - lo, dtype=arr.dtype)
        transfer(READ, fd, memoryview(dest.view(np.uint8)), base + lo * item,
                 short=lambda done: CheckpointError(f"{arr.where}: unreadable (the file ends at byte {size}, "
                                                    f"inside elements [{lo}, {hi})): truncated"))
        schema.check_block(arr, dest, b)
        if not whole:
            a, z = max(lo, start), min(hi, stop)
            out[a - start:z - start] = dest[a - lo:z - lo]
    return [lambda b=b: block(b) for b in _blocks(start, stop)]
