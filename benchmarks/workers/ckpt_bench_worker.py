"""Checkpoint benchmark worker: save, warm load and cold load of one GPT on N ranks.

    mpiexec -n N python -m mpi4py benchmarks/workers/ckpt_bench_worker.py --root DIR --out OUT.json

Builds the GPT, takes one AdamW step (so the optimizer state exists), then --repeats times: save tag
``repI``, load it with the files in the page cache (warm), evict them, load again (cold). Each collective
call is timed on every rank between barriers; timers wrapped around zerompi's checkpoint functions at run
time (its code is unchanged) split each rank's time into HDF5 I/O, CRC-32, fsync and verification. Rank 0
writes JSON; only the last tag stays on disk. The page-cache, raw-I/O and child-process helpers are
shared with ``bench_checkpoint.py``.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
import time
import types
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled
import zerompi  # noqa: E402
from zerompi.checkpoint import reader, schema, writer  # noqa: E402
from zerompi.models.gpt import GPT, GPTConfig  # noqa: E402

log = logging.getLogger("ckpt_bench_worker")
BLOCK = 8 << 20  # raw I/O block
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.malloc_trim.argtypes = [ctypes.c_size_t]
_LAUNCHER = ("import os, subprocess, sys\nproc = subprocess.Popen(sys.argv[1:])\n"
             "_, status, usage = os.wait4(proc.pid, 0)\n"
             "print(f'\\nPEAK {usage.ru_maxrss * 1024} {os.waitstatus_to_exitcode(status)}')\n")


# ---- page cache, raw I/O, child processes -----------------------------------
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


def _in_threads(paths: list[Path], work) -> float:
    """Seconds for ``work(path)`` on every path at once, one thread each (a thread's exception is raised)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(work, paths))
    return time.perf_counter() - t0


def raw_write(paths: list[Path], per_file: int, buf: memoryview) -> float:
    """Write ``per_file`` bytes to each path in BLOCK-sized writes of ``buf``, then fsync."""
    def work(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(per_file // BLOCK):
                if os.write(fd, buf) != BLOCK:
                    raise OSError(f"short write to {path}")
            os.fsync(fd)
        finally:
            os.close(fd)
    return _in_threads(paths, work)


def raw_read(paths: list[Path]) -> float:
    def work(path: Path) -> None:
        buf = bytearray(BLOCK)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return _in_threads(paths, work)


def raw_io(directory: Path, nbytes: int, threads: int, buf: memoryview) -> dict:
    """Write ``nbytes`` over ``threads`` files (+fsync), read them cold, then warm; seconds."""
    paths = [directory / f"raw-{threads}-{i}.bin" for i in range(threads)]
    per_file = nbytes // threads // BLOCK * BLOCK
    write = raw_write(paths, per_file, buf)
    evict(paths)
    resident = resident_fraction(paths)
    cold, warm = raw_read(paths), raw_read(paths)
    for p in paths:
        p.unlink()
    return {"bytes": per_file * threads, "write": write, "read_cold": cold, "read_warm": warm,
            "resident_after_evict": resident}


def crc32_gibps(seconds: float = 1.0) -> float:
    """Single-thread zlib.crc32 throughput over an 8 MiB buffer."""
    buf, n, t0 = os.urandom(BLOCK), 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        zlib.crc32(buf)
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


# ---- timers and memory ------------------------------------------------------
class Timers:
    """Seconds in functions wrapped at run time. A *phase* function records under its own name and
    encloses the calls it makes; others record as ``name@phase`` (e.g. ``crc32@verify``)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.phase = "call"

    def wrap(self, owner, name: str, key: str, phase: bool = False) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            outer = self.phase
            if phase:
                self.phase = key
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key if phase else f"{key}@{outer}"] += time.perf_counter() - t0
                self.phase = outer

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def instrument(timers: Timers) -> None:
    """Wrap the checkpoint functions whose time we split out (module globals, looked up per call)."""
    for name, key in (("_write_rank_file", "write_rank_file"), ("verify_file", "verify"),
                      ("_write_index", "write_index"), ("_publish", "publish")):
        timers.wrap(writer, name, key, phase=True)
    timers.wrap(reader, "prepare", "prepare", phase=True)
    timers.wrap(reader, "apply", "apply", phase=True)
    timers.wrap(writer, "fsync_path", "fsync")
    timers.wrap(schema, "read_array", "read")
    crc = types.SimpleNamespace(crc32=zlib.crc32)
    timers.wrap(crc, "crc32", "crc32")
    schema.zlib = crc  # schema calls zlib.crc32 through its module global


def proc_status_bytes(key: str) -> int:
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith(key + ":"))


def timed_collective(comm, timers: Timers, fn) -> list[dict] | None:
    """Run ``fn`` on every rank between barriers; rank 0 gets each rank's seconds, CPU seconds, parts and
    peak RSS growth. Free heap memory goes back to the system first, so that every call pays for the
    pages it allocates (as in a fresh job) whatever the calls before it freed."""
    _libc.malloc_trim(0)
    comm.Barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    rss0 = proc_status_bytes("VmRSS")
    timers.take()
    t0, cpu0 = time.perf_counter(), time.process_time()
    fn()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    row = {"seconds": seconds, "cpu_seconds": cpu, "parts": timers.take(),
           "peak_rss_growth": proc_status_bytes("VmHWM") - rss0}
    return comm.gather(row, root=0)


# ---- the job ----------------------------------------------------------------
def build_engine(args, rank: int):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    t0 = time.perf_counter()
    model = GPT(cfg)
    engine = zerompi.initialize(model, zerompi.ZeroConfig(stage=3, optimizer="adamw", dtype="fp32", lr=1e-4,
                                                          checkpoint_layout=args.layout))
    data = torch.randint(0, 256, (1, args.block + 1), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(data[:, :-1], data[:, 1:])[1])
    engine.step()
    info = {"params": sum(p.numel() for p in model.parameters()),
            "largest_tensor": max(p.numel() for p in model.parameters()),
            "model_state_bytes": engine.stats.model_state_bytes, "setup_seconds": time.perf_counter() - t0}
    return engine, info


def _load(engine, root: Path, tag: str, rep: int) -> None:
    state = engine.load_checkpoint(root, tag)
    if state != {"rep": rep}:
        raise RuntimeError(f"load of {tag} returned client_state {state!r}")


def run(args, comm, engine, timers: Timers) -> list[dict]:
    rank, root, rows = comm.Get_rank(), Path(args.root), []
    for rep in range(args.repeats):
        tag = f"rep{rep}"
        save = timed_collective(comm, timers, lambda: engine.save_checkpoint(root, tag=tag, client_state={"rep": rep}))
        files = files_under(root / tag) if rank == 0 else []
        after_save = resident_fraction(files) if rank == 0 else None
        warm = timed_collective(comm, timers, lambda: _load(engine, root, tag, rep))
        if rank == 0:
            evict(files)
        after_evict = resident_fraction(files) if rank == 0 else None
        cold = timed_collective(comm, timers, lambda: _load(engine, root, tag, rep))
        if rank == 0:
            rows.append({"rep": rep, "bytes": sum(p.stat().st_size for p in files), "files": len(files),
                         "resident_after_save": after_save, "resident_after_evict": after_evict,
                         "save": save, "load_warm": warm, "load_cold": cold})
            log.info("rep %d: save %.2f s, warm load %.2f s, cold load %.2f s (resident after evict %.1f%%)",
                     rep, max(r["seconds"] for r in save), max(r["seconds"] for r in warm),
                     max(r["seconds"] for r in cold), 100 * after_evict)
            if rep < args.repeats - 1:
                shutil.rmtree(root / tag)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="checkpoint root to write")
    p.add_argument("--out", required=True, help="JSON results (rank 0)")
    for name, default in (("repeats", 3), ("n-layer", 22), ("n-embd", 1024), ("n-head", 16), ("block", 64)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--layout", default="auto", help="checkpoint_layout: auto, per_rank or shared")
    args = p.parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    logging.basicConfig(level=logging.INFO if comm.Get_rank() == 0 else logging.WARNING,
                        format=f"[{comm.Get_size()} ranks] %(message)s")
    engine, info = build_engine(args, comm.Get_rank())
    log.info("%d parameters, set up and one step in %.1f s", info["params"], info["setup_seconds"])
    timers = Timers()
    instrument(timers)
    rows = run(args, comm, engine, timers)
    if comm.Get_rank() == 0:
        Path(args.out).write_text(json.dumps({"world_size": comm.Get_size(), **info, "reps": rows}))


if __name__ == "__main__":
    main()
