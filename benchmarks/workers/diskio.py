"""What the checkpoint benchmarks measure the disk with: the page cache (evict, what is resident), raw I/O of
a rank's bytes in several ways, CRC-32 throughput, and a child process's peak RSS.

Shared by workers/ckpt_bench_worker.py (under mpiexec) and the drivers bench_checkpoint.py and
bench_checkpoint_layouts.py.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # rawdisk.py
import rawdisk  # noqa: E402

BLOCK = 8 << 20  # the CRC-32 throughput buffer
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.malloc_trim.argtypes = [ctypes.c_size_t]
_LAUNCHER = ("import os, subprocess, sys\nproc = subprocess.Popen(sys.argv[1:])\n"
             "_, status, usage = os.wait4(proc.pid, 0)\n"
             "print(f'\\nPEAK {usage.ru_maxrss * 1024} {os.waitstatus_to_exitcode(status)}')\n")


def files_under(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (fsync first: only clean pages can be dropped)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resident_pages(path: Path) -> tuple[int, int]:
    """(pages in the page cache, pages) of one file: mincore(2) on a shared read-only mapping."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    if size == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
    try:
        vec = np.zeros(pages, dtype=np.uint8)
        if _libc.mincore(addr, size, vec.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        return int((vec & 1).sum()), pages
    finally:
        _libc.munmap(addr, size)


def resident_fraction(paths: list[Path]) -> float:
    counts = [_resident_pages(p) for p in paths]
    total = sum(n for _, n in counts)
    return sum(r for r, _ in counts) / total if total else 0.0


RAW_CONFIGS = (  # (O_DIRECT, threads, block MiB): the ways the raw rows write and read a rank's bytes
    *((True, t, 8) for t in (1, 2, 4, 8)), (True, 4, 1), (True, 8, 1), (True, 4, 32), (True, 8, 32),
    (True, 2, 4),  # the save's own requests: 4 MiB checksum blocks on 2 threads
    (False, 1, 8), (False, 4, 8))


def raw_name(direct: bool, threads: int, mib: int) -> str:
    return f"{'O_DIRECT' if direct else 'buffered'}, {threads} thread{'s' * (threads > 1)}, {mib} MiB"


def raw_write(path: Path, size: int, direct: bool, threads: int, block: int, bufs: list) -> None:
    """A new file of ``size`` bytes (a multiple of 4 KiB), written then fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    try:
        rawdisk.strided(fd, size, threads, block, bufs, write=True)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, size: int, direct: bool, threads: int, block: int, bufs: list) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        rawdisk.strided(fd, size, threads, block, bufs, write=False)
    finally:
        os.close(fd)


def crc32_gibps(seconds: float = 1.0) -> float:
    """Single-thread throughput of the CRC-32 zerompi uses (zlib-ng's when installed) over an 8 MiB buffer."""
    from zerompi.checksum import crc32
    buf, n, t0 = os.urandom(BLOCK), 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        crc32(buf)
        n += 1
    return n * BLOCK / (1 << 30) / (time.perf_counter() - t0)


def child_peak_rss(cmd: list[str], env: dict, cwd: Path) -> tuple[float, int, str]:
    """(seconds, peak RSS in bytes, output) of ``cmd``, from wait4's rusage in a small launcher: a
    child's ru_maxrss starts at the RSS of the process that forked it, so that process must be small."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, *cmd], env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    head, _, tail = proc.stdout.rpartition("\nPEAK ")
    peak, rc = map(int, tail.split()) if tail else (0, proc.returncode or 1)
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return seconds, peak, (head + proc.stderr).strip()


def trim_heap() -> None:
    """Return the allocator's free memory to the system (glibc), so that RSS shows what is live."""
    _libc.malloc_trim(0)
