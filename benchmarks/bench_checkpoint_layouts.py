"""Checkpoint layouts side by side: one file per rank against one shared file through MPI-IO.

    python benchmarks/bench_checkpoint_layouts.py [--dir DIR] [--quick] [--ranks 2]

Both layouts run in the same environment, so only the layout differs: the parallel-h5py venv
of jobs/ci/parallel_h5py.sh (Debian's HDF5 with Open MPI, mpiexec.openmpi). Each job is
workers/ckpt_bench_worker.py (save, warm load, cold load; --repeats times); raw buffered
write + fsync and cold read of as many bytes, on the same disk, in the same run. Results:
benchmarks/results/checkpoint_layouts.{json,md} (with --quick: under DIR).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE / "workers")]
import rawdisk  # noqa: E402  (beside this file)
import ckpt_bench_worker as worker  # noqa: E402
import diskio  # noqa: E402
from bench_checkpoint import MODELS, machine  # noqa: E402
from harness import launch, markdown, stamp  # noqa: E402
from harness.summary import fmt_spread, spread  # noqa: E402

log = logging.getLogger("bench_checkpoint_layouts")
GiB = 1 << 30
VENV = ROOT / ".venv-mpio"
LAYOUTS = ("per_rank", "shared")


def run_job(layout: str, ranks: int, scratch: Path, model: dict, repeats: int) -> dict:
    shutil.rmtree(scratch / "ckpt", ignore_errors=True)
    out = scratch / f"{layout}.json"
    # Debian's Open MPI picks its own transports; MPICH's settings mean nothing to it
    env = {k: v for k, v in launch.job_env(mpich_yield=False).items() if not k.startswith(("OMPI_MCA_", "MPIR_"))}
    cmd = launch.mpi_command(ranks, worker.__file__, "--root", scratch / "ckpt", "--out", out, "--repeats", repeats,
                             "--layout", layout, *(f"--{k.replace('_', '-')}={v}" for k, v in model.items()),
                             mpiexec=["mpiexec.openmpi", "--oversubscribe"], python=VENV / "bin" / "python")
    job, data = launch.run_json(cmd, out, env)
    job.check()
    files = sorted(p.name for p in (scratch / "ckpt" / f"rep{repeats - 1}").iterdir())
    return {**data, "files": files}


def summarise(job: dict) -> dict:
    """GiB/s per call kind: bytes on disk / the slowest rank's seconds, median over repeats."""
    out = {}
    for kind in ("save", "load_warm", "load_cold"):
        rates = [r["bytes"] / max(x["seconds"] for x in r[kind]) / GiB for r in job["reps"]]
        out[kind] = spread(rates)
    out["bytes"] = job["reps"][0]["bytes"]
    return out


def raw(scratch: Path, nbytes: int, repeats: int) -> dict:
    """GiB/s of as many bytes on the same disk: 2 threads, buffered 8 MiB writes + fsync, then a cold read."""
    path, size, block = scratch / "raw.bin", nbytes // (8 << 20) * (8 << 20), 8 << 20
    bufs, rates = rawdisk.page_aligned(2, block), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        diskio.raw_write(path, size, False, 2, block, bufs)
        diskio.evict([path])
        t1 = time.perf_counter()
        diskio.raw_read(path, size, False, 2, block, bufs)
        rates.append({"write": size / GiB / (t1 - t0), "read_cold": size / GiB / (time.perf_counter() - t1)})
        path.unlink()
    return {k: statistics.median([r[k] for r in rates]) for k in ("write", "read_cold")}


def markdown_report(data: dict) -> str:
    m, raw_io = data["machine"], data["raw"]
    lines = [
        "# Checkpoint layouts: one file per rank against one shared file (MPI-IO)", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, Python {m['python']}; disk `{m['dir']}` "
        f"on {m['fs']}. Date {data['date']}, commit {data['commit']}. Run: `{data['command']}`.", "",
        f"Model: GPT {', '.join(f'{k} {v}' for k, v in data['model'].items())}, {data['params'] / 1e6:.1f}M parameters, ZeRO-3 fp32 AdamW after one step, "
        f"{data['ranks']} ranks. Both layouts in the same venv (Debian's parallel h5py {data['h5py']}, HDF5 "
        f"{data['hdf5']}, Open MPI), so only the layout differs. GiB/s = bytes on disk / the slowest rank's "
        f"time; median (min–max) of {data['repeats']} repeat(s). Raw: 2 threads, buffered 8 MiB writes + fsync, "
        "then a cold read (pages evicted), as many bytes.", "",
        "| layout | files | save GiB/s | warm load GiB/s | cold load GiB/s | save / raw write | cold load / raw read |",
        "|---|---|---|---|---|---|---|"]
    for layout in LAYOUTS:
        s = data["layouts"][layout]
        lines.append(f"| {layout} | {', '.join(data['files'][layout])} | {fmt_spread(s['save'])} | "
                     f"{fmt_spread(s['load_warm'])} | {fmt_spread(s['load_cold'])} | "
                     f"{100 * s['save']['median'] / raw_io['write']:.0f}% | "
                     f"{100 * s['load_cold']['median'] / raw_io['read_cold']:.0f}% |")
    lines += ["", f"Raw on the same disk: write + fsync {raw_io['write']:.2f} GiB/s, cold read "
              f"{raw_io['read_cold']:.2f} GiB/s.", "", data["reading"], ""]
    return "\n".join(lines)


def reading(data: dict) -> str:
    a, b = data["layouts"]["per_rank"], data["layouts"]["shared"]
    ratio = lambda k: b[k]["median"] / a[k]["median"]  # noqa: E731
    return (f"Reading: the shared file saves at {ratio('save'):.2f}× and cold-loads at {ratio('load_cold'):.2f}× "
            "the per-rank layout's bandwidth here. One local disk has no storage servers for MPI-IO's "
            "collective buffering to spread over, so this run bounds what the layout costs, not what it "
            "gains on Lustre or GPFS, where one striped file spares the metadata servers one file per rank.")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--quick", action="store_true", help="~50M parameters, one repeat")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    repeats = args.repeats or (1 if args.quick else 3)
    subprocess.run(["bash", str(ROOT / "jobs/ci/parallel_h5py.sh"), str(VENV)], check=True)
    scratch = args.dir / "zerompi-ckpt-layouts"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    model = MODELS["quick" if args.quick else "full"]
    try:
        jobs = {layout: run_job(layout, args.ranks, scratch, model, repeats) for layout in LAYOUTS}
        layouts = {k: summarise(v) for k, v in jobs.items()}
        for k, v in layouts.items():
            log.info("%s: %s", k, {kind: round(x["median"], 2) for kind, x in v.items() if kind != "bytes"})
        raw_io = raw(scratch, layouts["per_rank"]["bytes"], repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    versions = subprocess.run([str(VENV / "bin" / "python"), "-c", "import h5py; print(h5py.version.version, "
                               "h5py.version.hdf5_version)"], capture_output=True, text=True).stdout.split()
    data = {"machine": machine(args.dir), "date": stamp.utc_now(), "commit": stamp.commit(short=True),
            "stamp": stamp.stamp(), "command": "python benchmarks/bench_checkpoint_layouts.py"
            + (" --quick" if args.quick else ""), "model": model, "params": jobs["shared"]["params"],
            "ranks": args.ranks, "repeats": repeats, "h5py": versions[0], "hdf5": versions[1],
            "layouts": layouts, "files": {k: v["files"] for k, v in jobs.items()}, "raw": raw_io}
    data["reading"] = reading(data)
    out = args.out or (scratch.parent / "zerompi-ckpt-layouts-results" if args.quick else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_layouts.json").write_text(json.dumps(data, indent=1))
    print(markdown.write(out / "checkpoint_layouts.md", markdown_report(data)).read_text())


if __name__ == "__main__":
    main()
