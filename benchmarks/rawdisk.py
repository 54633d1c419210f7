"""Raw block I/O as fio does it, for the benchmarks' "raw" rows: the yardstick the swap files
(bench_swap.py, bench_offload.py) and checkpoints (workers/ckpt_bench_worker.py) are measured against.

One file, ``threads`` threads, thread t taking blocks t, t + threads, ... with pwrite/preadv at their
offsets from page-aligned buffers (anonymous mappings), so the same calls serve O_DIRECT and buffered
files. What the file is opened with, and what is timed around it, is the caller's.
"""
from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor

MiB = 1 << 20


def page_aligned(threads: int, block: int) -> list[mmap.mmap]:
    """One page-aligned buffer of ``block`` random bytes per thread (a whole number of MiB), faulted in now."""
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]
    for buf in bufs:
        buf.write(os.urandom(MiB) * (block // MiB))
    return bufs


def strided(fd: int, size: int, threads: int, block: int, bufs: list[mmap.mmap], write: bool) -> None:
    """``size`` bytes of ``fd`` in ``block``-sized calls (the last may be shorter), thread t taking blocks
    t, t + threads, ...; a thread's error is raised here."""
    def work(t: int) -> None:
        view = memoryview(bufs[t])
        for at in range(t * block, size, threads * block):
            want, done = min(block, size - at), 0
            while done < want:
                got = (os.pwrite(fd, view[done:want], at + done) if write
                       else os.preadv(fd, [view[done:want]], at + done))
                if got <= 0:
                    raise OSError(f"raw I/O stopped at byte {at + done} of {size}")
                done += got
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))  # list(): re-raises a thread's error
