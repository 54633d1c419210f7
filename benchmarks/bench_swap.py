"""NVMeSwapper throughput against raw O_DIRECT I/O on the same disk.

Raw: one file of --size written sequentially in 8 MiB blocks by 1, 2, 4 or 8
threads (each takes every T-th block), fsync included, then read back; O_DIRECT
reads bypass the page cache, so they are cold without dropping caches. The
file is either fresh for every measurement ("fresh") or written once before
timing and overwritten in place ("rewrite"), which is what a swapper does
every step after the first.

Swapper: the same number of bytes as four equal fp32 tensors (master weights,
two Adam moments, one more shard), written (plus fsync of the file) and read
back, for the default SwapConfig and a few others, from ordinary tensors
(staged through the buffer pool) and from page-aligned ones (no copy). Regions are reserved and
written once before timing, as an engine reserves them at start and then
overwrites them every step.

Every case runs --repeats times. Each repeat runs every case once, in a
shuffled order, so that drifts of the disk hit all cases alike and no case
always follows the same other. Ratios to raw are taken within a repeat.
Results: benchmarks/results/swap.md and swap.jsonl.

    python benchmarks/bench_swap.py [--dir /tmp] [--size 1G] [--repeats 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import mmap
import os
import random
import sys
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rawdisk.py, the harness
import rawdisk  # noqa: E402
from harness import rows, stamp  # noqa: E402
from harness.summary import fmt_spread  # noqa: E402
from harness.summary import spread as summary  # noqa: E402
from zerompi.offload import NVMeSwapper, SwapConfig, aligned_empty, nvme  # noqa: E402

log = logging.getLogger("bench_swap")
MiB, GiB = 1 << 20, 1 << 30
RAW_BLOCK = 8 * MiB
ZLIB = "zlib"
class Case(NamedTuple):
    config: SwapConfig
    crc: str | None = None  # None: the crc32 nvme picked; ZLIB: zlib's
    aligned: bool = False  # tensors from aligned_empty (no staging copy)


SWAP_CASES = {
    # The engine swaps aligned tensors (offload/residency.py allocates swapped-in state with
    # aligned_empty); the unaligned row shows what the staging copy costs.
    "default, aligned tensors (the engine)": Case(SwapConfig(), aligned=True),
    "default, unaligned tensors": Case(SwapConfig()),
    "default, zlib crc32": Case(SwapConfig(), crc=ZLIB),
    "default, no crc": Case(SwapConfig(verify=False)),
    "1 thread": Case(SwapConfig(threads=1)),
    "2 threads, 4 MiB": Case(SwapConfig(block_bytes=4 * MiB, threads=2)),
    "4 threads, 16 MiB": Case(SwapConfig(block_bytes=16 * MiB, buffers=4)),
    "8 threads": Case(SwapConfig(threads=8)),
    "8 threads, no crc": Case(SwapConfig(threads=8, verify=False)),
}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": MiB, "G": GiB}
    scale = units.get(text[-1].upper(), 1)
    value = int(float(text[:-1] if text[-1].upper() in units else text) * scale)
    return value - value % RAW_BLOCK or RAW_BLOCK


def raw_once(path: str, size: int, threads: int, fresh: bool) -> tuple[float, float]:
    """Seconds to write (with fsync) and to read ``size`` bytes of ``path`` with O_DIRECT.

    ``fresh``: create the file now and delete it after; else overwrite it in place.
    """
    flags = os.O_RDWR | os.O_DIRECT | (os.O_CREAT | os.O_TRUNC if fresh else 0)
    fd = os.open(path, flags, 0o600)
    try:
        bufs = rawdisk.page_aligned(threads, RAW_BLOCK)
        nblocks = size // RAW_BLOCK

        def io(write: bool) -> None:
            rawdisk.strided(fd, nblocks * RAW_BLOCK, threads, RAW_BLOCK, bufs, write)

        t0 = time.perf_counter()
        io(write=True)
        os.fsync(fd)
        t1 = time.perf_counter()
        io(write=False)
        return t1 - t0, time.perf_counter() - t1
    finally:
        os.close(fd)
        if fresh:
            os.unlink(path)


class SwapCase:
    """One swapper config with its file, its tensors reserved, and the output tensors."""

    def __init__(self, directory: str, case: Case, tensors: dict[bool, tuple[list, list]]):
        self.swapper = NVMeSwapper(directory, 0, case.config)
        self.crc = zlib.crc32 if case.crc == ZLIB else nvme._crc32
        self.sources, self.outs = tensors[case.aligned]  # shared by cases: one runs at a time
        for i, t in enumerate(self.sources):
            self.swapper.reserve(f"b{i}.state", t.nbytes)
            self.swapper.write(f"b{i}.state", t)  # the first write allocates blocks: not timed
        self.swapper.wait_all()
        self.checked = False

    def once(self) -> tuple[float, float]:
        picked, nvme._crc32 = nvme._crc32, self.crc  # benchmark only: pick the crc32 implementation
        try:
            return self._once()
        finally:
            nvme._crc32 = picked

    def _once(self) -> tuple[float, float]:
        sw = self.swapper
        if not self.checked:  # the outputs are shared: clear them so the check below means something
            for out in self.outs:
                out.zero_()
        t0 = time.perf_counter()
        for i, t in enumerate(self.sources):
            sw.write(f"b{i}.state", t)
        sw.wait_all()
        fd = os.open(sw.path, os.O_RDONLY)  # the raw numbers include fsync too
        os.fsync(fd)
        os.close(fd)
        t1 = time.perf_counter()
        for i, out in enumerate(self.outs):
            sw.read(f"b{i}.state", out)
        sw.wait_all()
        t2 = time.perf_counter()
        if not self.checked:
            if not all(torch.equal(a, b) for a, b in zip(self.sources, self.outs)):
                raise RuntimeError("swapper read back different bytes than it wrote")
            self.checked = True
        return t1 - t0, t2 - t1


def crc32_gibps(crc32, seconds: float = 0.5) -> float:
    """Single-thread throughput of a crc32 over one 8 MiB block."""
    buf = mmap.mmap(-1, RAW_BLOCK)
    buf.write(os.urandom(RAW_BLOCK))
    view = memoryview(buf)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        crc32(view)
        n += 1
    return n * RAW_BLOCK / GiB / (time.perf_counter() - t0)


def rates(size: int, seconds: list[float]) -> list[float]:
    return [size / GiB / s for s in seconds]


def machine(directory: str) -> dict:
    return stamp.disk_machine(Path(directory))


def run(args) -> list[dict]:
    size, reps = args.size, args.repeats
    raw_cases = [(t, fresh) for fresh in (True, False) for t in (1, 2, 4, 8)]
    fresh_path = os.path.join(args.dir, f"bench-raw-fresh-{os.getpid()}.bin")
    kept_path = os.path.join(args.dir, f"bench-raw-kept-{os.getpid()}.bin")
    n_tensors = 4
    tensors = {}
    for aligned in (False, True):
        make = (lambda n: aligned_empty(n, torch.float32)) if aligned else torch.empty
        sources = [make(size // n_tensors // 4).normal_() for _ in range(n_tensors)]
        tensors[aligned] = (sources, [make(t.numel()).zero_() for t in sources])  # touched before timing
    cases = {n: c for n, c in SWAP_CASES.items() if c.crc != ZLIB or nvme._crc32 is not zlib.crc32}
    swap_cases = {name: SwapCase(args.dir, case, tensors) for name, case in cases.items()}
    try:
        open(kept_path, "wb").close()
        raw_once(kept_path, size, 4, fresh=False)  # allocate the file the rewrite cases overwrite
        runs = {f"raw, {t} thread{'s' * (t > 1)}, {'fresh' if fresh else 'rewrite'}":
                functools.partial(raw_once, fresh_path if fresh else kept_path, size, t, fresh)
                for t, fresh in raw_cases}
        runs.update({name: case.once for name, case in swap_cases.items()})
        times = {name: [] for name in runs}
        for rep in range(reps):
            log.info("repeat %d of %d", rep + 1, reps)
            order = list(runs)
            random.Random(rep).shuffle(order)  # no case always runs right after the same other one
            for name in order:
                times[name].append(runs[name]())
    finally:
        for case in swap_cases.values():
            case.swapper.close()
        for path in (fresh_path, kept_path):
            if os.path.exists(path):
                os.unlink(path)
    return make_rows(size, times, cases)


def make_rows(size: int, times: dict[str, list[tuple[float, float]]], cases: dict) -> list[dict]:
    """One row per case; each ratio is against the best raw case of the same repeat."""
    raw = [name for name in times if name not in cases]
    rows = []
    for name, pairs in times.items():
        row = {"case": name, "kind": "raw" if name in raw else "swapper", "bytes": size,
               "config": dataclasses.asdict(cases[name].config) if name in cases else None,
               "crc32": (cases[name].crc or nvme._crc32.__module__) if name in cases else None,
               "aligned": cases[name].aligned if name in cases else None}
        for i, phase in enumerate(("write", "read")):
            mine = rates(size, [p[i] for p in pairs])
            best = [max(rates(size, [times[r][k][i]])[0] for r in raw) for k in range(len(pairs))]
            row[f"{phase}_gibps"] = summary(mine)
            row[f"{phase}_vs_raw"] = summary([m / b for m, b in zip(mine, best)])
        rows.append(row)
    return rows


def _fmt(s: dict, pct: bool = False) -> str:
    return fmt_spread(s, "{:.0%}" if pct else "{:.2f}")


def _table_row(r: dict) -> str:
    c = r["config"] or {"block_bytes": RAW_BLOCK, "buffers": "", "verify": False}
    threads = c["threads"] if r["config"] else r["case"].split(",")[1].split()[0]
    crc = "off" if not c["verify"] else ("zlib" if r["crc32"] == ZLIB else "zlib-ng" if "ng" in r["crc32"] else "zlib")
    return (f"| {r['case']} | {c['block_bytes'] // MiB} MiB | {threads} | {c['buffers']} | {crc} | "
            f"{_fmt(r['write_gibps'])} | {_fmt(r['read_gibps'])} | "
            f"{_fmt(r['write_vs_raw'], True)} | {_fmt(r['read_vs_raw'], True)} |")


def write_markdown(path: Path, rows: list[dict], meta: dict) -> None:
    m = meta["machine"]
    crcs = ", ".join(f"{k} {v:.2f} GiB/s" for k, v in meta["crc32_gibps"].items())
    lines = [
        "# NVMeSwapper vs raw O_DIRECT",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, kernel {m['kernel']}, Python {m['python']}, "
        f"torch {m['torch']}. Disk: `{m['dir']}` on {m['fs']} (`{m['device']}`, a virtio disk). "
        f"Date: {meta['date']}. Produced by `benchmarks/bench_swap.py`.",
        "",
        f"{meta['size'] / GiB:g} GiB per measurement. Raw: {RAW_BLOCK // MiB} MiB blocks, fsync included, "
        "a fresh file each time or one file overwritten in place (rewrite). Swapper: 4 fp32 tensors of "
        f"{meta['size'] / 4 / MiB:g} MiB from torch.empty (not page aligned, so every block is copied "
        "through a staging buffer) or, for \"aligned tensors\", from aligned_empty (no copy), regions "
        "reserved and written once before timing; write time "
        f"includes fsync of the file. Each case {meta['repeats']}×; each repeat runs all cases in a shuffled order. "
        "GiB/s as median (min–max) over repeats; \"/ raw\" is the case divided by the best raw case "
        "of the same repeat (so drift of the disk between repeats cancels), median (min–max).",
        "",
        f"Noise: the disk's speed drifts up to 2× within minutes, so single numbers vary a lot; compare "
        f"ratios. Whole run {meta['seconds']:.0f} s; 1-minute load average {meta['load'][0]:.1f} at the "
        f"start and {meta['load'][1]:.1f} at the end (it counts threads waiting on the disk, this run's "
        f"too). crc32 on one thread, 8 MiB buffer: {crcs}.",
        "",
        "| case | block | threads | buffers | crc | write GiB/s | read GiB/s | write / raw | read / raw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_table_row(r) for r in rows]
    lines += ["", _summary_line(rows)]
    path.write_text("\n".join(lines) + "\n")


def _summary_line(rows: list[dict]) -> str:
    swap = {r["case"]: r for r in rows if r["kind"] == "swapper"}

    def pct(name: str) -> str:
        r = swap[name]
        return f"{r['write_vs_raw']['median']:.0%} / {r['read_vs_raw']['median']:.0%}"

    best = max(swap, key=lambda n: swap[n]["write_vs_raw"]["median"] + swap[n]["read_vs_raw"]["median"])
    named = [n for n in ("default, aligned tensors (the engine)", "default, unaligned tensors", "default, no crc")
             if n in swap]
    return ("Summary (write / read, median share of raw): " + "; ".join(f"{n} {pct(n)}" for n in named)
            + f"; best swapper case: {best} {pct(best)}. Shares above 100% happen: the virtio disk is "
            "backed by the host's page cache, so raw is no hard ceiling here.")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp", help="directory on the disk to measure")
    p.add_argument("--size", type=parse_size, default=GiB, help="bytes per measurement, e.g. 1G, 512M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0, load0 = time.perf_counter(), stamp.loadavg()[0]
    crc = {"zlib": crc32_gibps(zlib.crc32)}
    if nvme._crc32 is not zlib.crc32:
        crc["zlib-ng"] = crc32_gibps(nvme._crc32)
    found = run(args)
    meta = {"date": stamp.utc_now(), "size": args.size, "repeats": args.repeats, "machine": machine(args.dir),
            "crc32_gibps": crc, "seconds": time.perf_counter() - t0, "load": [load0, stamp.loadavg()[0]]}
    rows.write(args.out / "swap.jsonl", [{**row, **meta} for row in found])
    write_markdown(args.out / "swap.md", found, meta)
    log.info("%s", (args.out / "swap.md").read_text())


if __name__ == "__main__":
    main()
