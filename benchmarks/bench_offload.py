"""CPU and NVMe offload: ZeRO-3 step time, memory and swap traffic; the CPU AdamW kernels; the disk.

    python benchmarks/bench_offload.py [--dir /tmp] [--steps 5] [--warmup 1]

Measured by ``workers/offload_bench_worker.py`` under mpiexec: the disk's raw O_DIRECT bandwidth; the 20M GPT at
stage 3 on 2 ranks, offload none / cpu / nvme taking turns in one job per dtype, then one job per row for peak RSS;
none / cpu / nvme parity per optimizer_kwargs; torch.optim.AdamW default vs foreach vs fused. Results: --out.{md,jsonl}.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # rawdisk.py, the harness
import rawdisk  # noqa: E402
from harness import launch, markdown, rows, stamp  # noqa: E402
from harness.markdown import table as _table  # noqa: E402
from harness.summary import fmt_spread as _f  # noqa: E402
from harness.summary import spread as summary  # noqa: E402

log = logging.getLogger("bench_offload")
WORKER = HERE / "workers" / "offload_bench_worker.py"
MiB, GiB = 1 << 20, 1 << 30
BLOCK, IO_THREADS = 8 * MiB, 4
MODES = ("none", "cpu", "nvme")
PHASES = ("total", "forward", "backward", "unshard", "step", "adam", "publish", "swap_wait")
TRANSFERS = ("optimizer_read", "optimizer_write", "param_read", "param_write")


def traffic_limit_s(read_bytes: float, written_bytes: float, read_gib_s: float, write_gib_s: float) -> float:
    """The least time one disk can take to read and write these bytes: neither stream beats its own raw
    rate whatever the other does, so the larger of the two times bounds a step from below. Their sum does
    not: the swap threads read and write at once, and a step may beat it."""
    return max(read_bytes / GiB / read_gib_s, written_bytes / GiB / write_gib_s)


def run_job(ranks: int, out: Path, *args: str) -> dict:
    """One ``mpiexec -n RANKS`` job of the worker; its JSON plus wall time and load averages."""
    cmd = launch.mpi_command(ranks, WORKER, "--out", out, *args)
    job, result = launch.run_json(cmd, out, launch.job_env(mpich_yield=True), timeout=900)
    job.check()  # the later rows compare against this one's
    return {**result, "job_s": job.wall_s, "load": [job.loadavg_before[0], job.loadavg_after[0]]}


def raw_disk(directory: Path, size: int, repeats: int) -> list[dict]:
    """O_DIRECT GiB/s, 8 MiB blocks, 4 threads: write + fsync of a file written once before (the swapper
    rewrites its regions every step), then a cold read after posix_fadvise(DONTNEED)."""
    path, nblocks = directory / f"raw-{os.getpid()}.bin", size // BLOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    bufs = rawdisk.page_aligned(IO_THREADS, BLOCK)

    def io(write: bool) -> None:
        rawdisk.strided(fd, nblocks * BLOCK, IO_THREADS, BLOCK, bufs, write)
    try:
        os.posix_fallocate(fd, 0, size)
        io(write=True)  # untimed: turns the allocation into written blocks
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            io(write=True)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)  # nothing cached under O_DIRECT: belt and braces
            t1 = time.perf_counter()
            io(write=False)
            out.append({"write": size / GiB / (t1 - t0), "read": size / GiB / (time.perf_counter() - t1)})  # GiB/s
        return out
    finally:
        os.close(fd)
        path.unlink()


def train_row(job: dict, mode: str, warmup: int) -> dict:
    """Step time of the slowest rank per step; phases as medians per rank, averaged over ranks."""
    mine = [r["modes"][mode] for r in job["ranks"]]
    ranks = [r["steps"][warmup:] for r in mine]
    per_rank = [{k: statistics.median(s[k] for s in r) for k in PHASES} for r in ranks]
    losses = [statistics.mean(r["steps"][i]["loss"] for r in mine) for i in range(len(ranks[0]) + warmup)]
    row = dict(kind="train", dtype=job["dtype"], mode=mode, params=job["params"], world_size=job["world_size"],
               step_s=summary([max(r[i]["total"] for r in ranks) for i in range(len(ranks[0]))]), losses=losses,
               phase_s={k: statistics.mean(p[k] for p in per_rank) for k in PHASES}, job_s=job["job_s"],
               load=job["load"], buckets=mine[0]["buckets"], o_direct=mine[0]["o_direct"])
    row.update({k: [r[k] for r in mine] for k in ("model_state_bytes", "swapped_bytes", "setup_s")})
    if mode == "nvme":  # per rank, medians over steps: swapper stats and traced transfers
        row["swap_per_step"] = [{k: statistics.median(s["swap"][k] for s in r) for k in r[0]["swap"]} for r in ranks]
        row["transfers"] = [{n: {k: statistics.median(s["transfers"][n][k] for s in r) for k in ("bytes", "seconds")}
                             for n in TRANSFERS} for r in ranks]
    return row


def machine(directory: Path) -> dict:
    m = stamp.disk_machine(directory)
    return dict(m, fs=f"{m['fs']} on {m['device']}")


def _slash(values: list, fmt: str) -> str:
    return "/".join(fmt.format(v) for v in values)


def _diff(d: dict) -> str:
    return f"{d['differing']:.2%} differ, ≤ {d['max_ulp_of_largest']:.2g} ulp of max" if d["differing"] else "bitwise"


def train_table(train: list[dict]) -> list[str]:
    body = [[r["dtype"], r["mode"], _f(r["step_s"]), *(f"{r['phase_s'][k]:.2f}" for k in PHASES[1:]),
             f"{r['offload_cost_s']:+.2f}",
             *(_slash([v / MiB for v in r[k]], "{:.0f}") for k in ("model_state_bytes", "swapped_bytes", "rss_peak"))]
            for r in train]
    return _table(["dtype", "offload", "step s, median (min–max)", "forward", "backward", "unshard", "step()",
                   "AdamW", "publish", "swap waits", "offload cost", "model state MiB", "swapped MiB", "peak RSS MiB"],
                  body)


def swap_table(train: list[dict], raw: dict) -> list[str]:
    body = []
    for r, name in ((r, name) for r in train if r["mode"] == "nvme" for name in TRANSFERS):
        nbytes, secs = ([t[name][k] for t in r["transfers"]] for k in ("bytes", "seconds"))
        rates = [b / GiB / t if t else 0.0 for b, t in zip(nbytes, secs)]  # 0: no such transfer in the step
        body.append([r["dtype"], name.replace("_", " "), _slash([b / MiB for b in nbytes], "{:.0f}"),
                     _slash(secs, "{:.3f}"), _slash(rates, "{:.2f}"), f"{sum(rates):.2f}",
                     f"{raw[name.split('_')[1]]['median']:.2f}"])
    return _table(["dtype", "transfer", "MiB/step per rank", "in flight s per rank", "GiB/s per rank",
                   "GiB/s sum of ranks", "raw O_DIRECT GiB/s"], body)


def limit_table(train: list[dict], raw: dict) -> list[str]:
    """Each nvme row's swap traffic per step (engine.stats.swap_read_bytes / swap_write_bytes differences)
    against what the disk can move: both ranks share it, so the limit is the larger of the sum of ranks'
    reads at the raw read bandwidth and the sum of their writes at the raw write bandwidth."""
    body, by = [], {(r["dtype"], r["mode"]): r for r in train}
    for r in (r for r in train if r["mode"] == "nvme"):
        reads, writes = ([s[k] for s in r["swap_per_step"]] for k in ("bytes_read", "bytes_written"))
        limit = traffic_limit_s(sum(reads), sum(writes), raw["read"]["median"], raw["write"]["median"])
        compute, step = by[r["dtype"], "none"]["step_s"]["median"], r["step_s"]["median"]
        body.append([r["dtype"], _slash([b / MiB for b in reads], "{:.0f}"), _slash([b / MiB for b in writes], "{:.0f}"),
                     f"{limit:.2f}", f"{compute:.2f}", f"{step:.2f}", f"{step / limit:.2f}",
                     f"{step / max(limit, compute):.2f}"])
    return _table(["dtype", "read MiB/step per rank", "written MiB/step per rank", "traffic limit s",
                   "compute s (offload none)", "nvme step s", "step / limit", "step / max(limit, compute)"], body)


def adam_table(adam: list[dict]) -> list[str]:
    body = [[f"{r['numel'] / 1e6:.1f}M", r["buckets"], r["threads"], r["kernel"], _f(r["ms"], "{:.0f}"),
             f"{r['speedup_vs_default']:.2f}", f"{r['speedup_vs_default_1thread']:.2f}",
             "; ".join(f"{k}: {_diff(d)}" for k, d in r["vs_default"].items() if d["differing"]) or "bitwise"]
            for r in adam]
    return _table(["elements", "buckets", "threads", "kernel", "ms/step, median (min–max)", "× default",
                   "× 1-thread default", f"result against default after {adam[0]['steps_taken']} steps"], body)


def parity_table(parity: list[dict]) -> list[str]:
    body = [[r["dtype"], json.dumps(r["optimizer_kwargs"]), *(_diff(r["vs_none"][m]) for m in MODES[1:]),
             _diff(r["vs_default_kernel"])] for r in parity]
    return _table(["dtype", "optimizer_kwargs", "cpu vs none", "nvme vs none", "none vs torch's for-loop kernel"], body)


def reading(train: list[dict]) -> list[str]:
    by, out = {(r["dtype"], r["mode"]): r for r in train}, []
    for dtype in ("fp32", "bf16"):
        n, v = by[dtype, "none"]["phase_s"], by[dtype, "nvme"]["phase_s"]
        sw = by[dtype, "nvme"]["swap_per_step"][0]
        moved = sw["bytes_read"] + sw["bytes_written"]
        out.append(f"- {dtype}: without offload, forward + backward take {n['forward'] + n['backward']:.2f} s of the "
                   f"{n['total']:.2f} s step, step() {n['step']:.2f} s (AdamW {n['adam']:.2f} s). Offload cost per "
                   f"step: cpu {by[dtype, 'cpu']['offload_cost_s']:+.2f} s, nvme "
                   f"{by[dtype, 'nvme']['offload_cost_s']:+.2f} s: {v['swap_wait']:.2f} s of swap waits in step(), "
                   f"{v['publish']:.2f} s in publish, unshard {v['unshard'] - n['unshard']:+.2f} s (parameter-shard "
                   f"reads). Each rank moves {moved / MiB:.0f} MiB per step, {sw['staged_bytes'] / max(moved, 1):.0%} "
                   "of it through staging copies.")
    if len(by["fp32", "nvme"]["buckets"]) == 1:
        out.append("- The whole model is one stage-3 gather unit and one bucket at bucket_mb 25 (no module with a "
                   "forward reaches 25 MiB on its own), so the nvme stream has nothing to overlap: each step reads all "
                   "the state, updates it, then writes it, and the parameter shard is read twice (forward, backward).")
    fwd = {d: [r["phase_s"]["forward"] + r["phase_s"]["backward"] - r["phase_s"]["unshard"] for r in train
               if r["dtype"] == d] for d in ("fp32", "bf16")}
    same = all(r["losses"] == by[r["dtype"], "none"]["losses"] for r in train)
    out.append("- Noise: forward + backward without the gathers is the same work in the three rows of a dtype; it "
               "ranged " + ", ".join(f"{min(v):.2f}–{max(v):.2f} s ({d})" for d, v in fwd.items()) + ". The losses "
               f"of none / cpu / nvme were {'identical' if same else 'NOT identical'} at every step.")
    return out


def markdown_report(meta: dict, rows: list[dict]) -> str:
    m, st = meta["machine"], meta["settings"]
    train, adam = [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "adam"]
    raw = {k: summary([s[k] for r in rows if r["kind"] == "raw_disk" for s in r["samples"]]) for k in ("write", "read")}
    nvme = next(r for r in train if r["mode"] == "nvme")
    buckets = ", ".join(f"'{b['unit'] or '<root>'}' {b['padded'] / 1e6:.2f}M" for b in nvme["buckets"])
    loads = "; ".join(f"{d} {a:.1f}→{b:.1f}" for d, (a, b) in {r["dtype"]: r["load"] for r in train}.items())
    return "\n".join([
        "# CPU and NVMe offload: step time, memory, swap traffic, CPU AdamW", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, kernel {m['kernel']}, Python {m['python']}, "
        f"torch {m['torch']}, zerompi commit {m['commit']}. Disk: `{m['dir']}`, {m['fs']}; swap files opened with "
        f"O_DIRECT: {nvme['o_direct']}. Date: {meta['date']}. One run of `benchmarks/bench_offload.py`, "
        f"{meta['seconds']:.0f} s.", "",
        f"Model: the 20M GPT of `benchmarks/peers` (6 layers, d512, 8 heads, vocab 256, block 256, "
        f"{nvme['params'] / 1e6:.2f}M parameters), micro-batch 4 × 256 tokens per rank, {nvme['world_size']} ranks, "
        "ZeRO stage 3, AdamW (lr 3e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01), bucket_mb 25, 1 torch thread "
        "per rank; `offload_optimizer` = `offload_params` = the row's offload; nvme with zerompi's defaults (8 MiB "
        f"blocks, 4 I/O threads, 8 buffers, CRC-32 on). Buckets: {buckets}. Timing: one mpiexec job per dtype whose "
        f"three engines take turns step by step (the first rotates), {st['warmup']} warm-up + {st['steps']} timed "
        "steps each; peak RSS: one job per row (one step), so that ru_maxrss is the row's own.", "",
        f"Noise: the machine is shared; 1-minute load average {meta['load_start'][0]:.1f} at the start, "
        f"{meta['load_end'][0]:.1f} at the end, per timing job (before→after): {loads}.", "",
        "## Training step (seconds; phases: median over steps, mean over ranks; memory: rank 0/rank 1)", "",
        "Step: slowest rank, from a barrier to `loss.item()` after `engine.step()`. `unshard`: all-gathers in forward "
        "and backward (nvme: plus the parameter-shard read); `AdamW`, `publish` (master → parameter shard; nvme: "
        "plus its write) and `swap waits` (optimizer state reads and writes) are parts of `step()`. Offload cost: "
        "unshard + step() over those of the same dtype without offload (the rest of forward and backward is the same "
        "work in every row). Model state: `engine.stats.model_state_bytes`; swapped: `engine.stats.swapped_bytes`; "
        "peak RSS: ru_maxrss.", "",
        *train_table(train),
        "## NVMe swap traffic per step (median over steps; per rank: rank 0/rank 1)", "",
        "In flight: wall time with at least one such transfer outstanding (traced read/write Futures). Sum of ranks: "
        "both ranks make the same transfers at about the same time, so the disk sees about the sum. The swapper "
        "never fsyncs, so its writes can beat raw write + fsync (the virtio disk sits on the host's page cache). Raw: "
        f"O_DIRECT, 8 MiB blocks, 4 threads, one process, {st['raw_size'] / MiB:.0f} MiB, write + fsync and cold read, "
        f"before and after the training rows: write {_f(raw['write'])}, read {_f(raw['read'])} GiB/s.", "",
        *swap_table(train, raw),
        "## NVMe steps against the traffic limit (medians)", "",
        "Bytes: `engine.stats.swap_read_bytes` / `swap_write_bytes` across a step, per rank (4 KiB pages included). "
        "Traffic limit: the least time the disk needs for both ranks' bytes at the raw O_DIRECT bandwidths above: the "
        "larger of the read time and the write time (the swap threads read and write at once, so a step can beat "
        "their sum, not this). Compute: the step without offload, same dtype, same job. Issue 16's target "
        "is a step of at most 1.3× max(limit, compute).", "",
        *limit_table(train, raw),
        "## torch.optim.AdamW on flat fp32 buckets of 25 MiB (one process)", "",
        "Default: torch's own CPU default (foreach=None: a for-loop over the buckets); zerompi's default for "
        "Adam/AdamW state in host memory is the fused kernel (README, Offload). Each step of every kernel and "
        "thread count in turn, the same gradients for all; the result column compares parameters and both moments "
        "after the same steps (ulp of max: the difference in units in the last place of the tensor's largest "
        "entry). 2 threads share the 2 cores with any other job, and each parallel region waits for its "
        "slower thread.", "",
        *adam_table(adam),
        "## Bitwise parity of none / cpu / nvme per optimizer_kwargs (tiny GPT, 2 ranks, 3 steps)", "",
        *parity_table([r for r in rows if r["kind"] == "parity"]),
        "## Reading", "", *reading(train), ""])


def measure(args, scratch: Path) -> list[dict]:
    rows = [dict(kind="raw_disk", when="before", samples=raw_disk(scratch, args.raw_size, args.raw_repeats))]
    for dtype in ("fp32", "bf16"):  # timing: one job per dtype, the three modes taking turns step by step
        log.info("timing none / cpu / nvme, %s", dtype)
        (swap := scratch / f"swap-{dtype}").mkdir()
        job = run_job(args.np, scratch / "t.json", "--modes", *MODES, "--dtype", dtype, "--swap", str(swap),
                      "--steps", str(args.steps), "--warmup", str(args.warmup))
        rows += [train_row(job, mode, args.warmup) for mode in MODES]
    none = {r["dtype"]: r["phase_s"] for r in rows[1:] if r["mode"] == "none"}
    for r in rows[1:]:  # what offload adds: unshard + step() over those of the same dtype without offload
        r["offload_cost_s"] = sum(r["phase_s"][k] - none[r["dtype"]][k] for k in ("unshard", "step"))
        (swap := scratch / f"swap-{r['dtype']}-{r['mode']}").mkdir()
        job = run_job(args.np, scratch / "m.json", "--modes", r["mode"], "--dtype", r["dtype"], "--swap", str(swap),
                      "--steps", "0", "--warmup", "1")
        r.update(rss_peak=[k["rss_peak"] for k in job["ranks"]], memory_job_s=job["job_s"])  # one job per row
    rows.append(dict(kind="check", swap_files_left=sorted(f for d in scratch.glob("swap-*") for f in os.listdir(d))))
    rows.append(dict(kind="raw_disk", when="after", samples=raw_disk(scratch, args.raw_size, args.raw_repeats)))
    log.info("parity check (tiny GPT, %d ranks), then the AdamW kernels (1 rank)", args.np)
    parity = run_job(args.np, scratch / "p.json", "--parity", "--swap", str(swap))
    rows += [dict(kind="parity", world_size=parity["world_size"], **r) for r in parity["rows"]]
    adam = run_job(1, scratch / "a.json", "--adam", "--warmup", "1", "--adam-numel", *map(str, args.adam_numel),
                   "--adam-steps", *map(str, args.adam_steps))
    return rows + [dict(kind="adam", **r, ms=summary([s * 1e3 for s in r["seconds"]])) for r in adam["rows"]]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp"), help="the disk under test (swap files, raw I/O)")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed training steps per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed training steps first")
    p.add_argument("--raw-size", type=int, default=512 * MiB)
    p.add_argument("--raw-repeats", type=int, default=3)
    p.add_argument("--adam-numel", type=int, nargs="+", default=[19_177_472, 120_000_000])
    p.add_argument("--adam-steps", type=int, nargs="+", default=[5, 2], help="timed steps per --adam-numel")
    p.add_argument("--out", type=Path, default=HERE / "results" / "offload")
    p.add_argument("--report-only", action="store_true", help="rewrite the md from the jsonl of --out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.report_only:
        meta, *found = rows.read(args.out.with_suffix(".jsonl"))
        markdown.write(args.out.with_suffix(".md"), markdown_report(meta, found))
        return
    t0, load0 = time.perf_counter(), stamp.loadavg()
    scratch = Path(tempfile.mkdtemp(prefix="zerompi-offload-bench-", dir=args.dir))
    try:
        found = measure(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta = dict(kind="meta", date=stamp.utc_now(), machine=machine(args.dir), seconds=time.perf_counter() - t0,
                load_start=load0, load_end=stamp.loadavg(),
                settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    rows.write(args.out.with_suffix(".jsonl"), [meta, *found])
    markdown.write(args.out.with_suffix(".md"), markdown_report(meta, found))


if __name__ == "__main__":
    main()
