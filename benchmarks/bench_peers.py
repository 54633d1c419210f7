"""zerompi stages 0-3 beside DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, in one run.

Every row trains the same GPT from the same initial weights on the same data
(micro-batch 4 per rank, sequence 256, fp32 AdamW lr 3e-4 wd 0.01, one torch
thread per rank) as its own ``mpiexec`` job with a timeout; the torch.distributed
rows rendezvous over gloo on 127.0.0.1 with rank and size from MPI. A row that
fails or times out is recorded with its error and the run goes on.

The whole list of rows runs ``--repeats`` times (default 3), interleaved: repeat 1 of every
row, then repeat 2 of every row, and so on, so that a drifting machine hits every row alike.
The report gives each row's median over repeats, their spread, and ratios with the range
the spreads allow ("at parity" where it contains 1.0; peers/repeats.py).

    benchmarks/.venv-peers/bin/python benchmarks/bench_peers.py \
        [--sizes 20M,120M] [--np 2,4] [--cases 20M:2,120M:2] [--repeats 3] [--steps N]
        [--rows zerompi-3,ddp,...] [--quick]

Set up the venv first: ``bash benchmarks/setup_peers.sh``. Results go to
``benchmarks/results/peers.{md,jsonl}`` and ``peers-time.png`` / ``peers-memory.png``
(``--quick``: ``peers-quick.*``); see benchmarks/README.md for the columns.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from peers import plots, report  # noqa: E402
from peers import repeats as rp  # noqa: E402


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    runner: str      # script under benchmarks/peers/
    variant: str
    ideal_psi: int   # ZeRO-paper volume of this sharding: 2 (stages 0-2) or 3 (stage 3) x (N-1)/N x 4 bytes x params
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the row's job


ROWS = [
    Row("zerompi-0", "zerompi stage 0", "run_zerompi.py", "0", 2),
    Row("zerompi-1", "zerompi stage 1", "run_zerompi.py", "1", 2),
    Row("zerompi-2", "zerompi stage 2", "run_zerompi.py", "2", 2),
    Row("zerompi-3", "zerompi stage 3", "run_zerompi.py", "3", 3),
    # Overlap, and how non-blocking collectives progress while Python computes: by MPICH alone,
    # by MPI_Test from the gradient hooks (mpi_progress='test'), by our communication thread
    # (mpi_progress='thread'), or by MPICH's progress thread.
    Row("zerompi-2-ov", "zerompi stage 2, overlap", "run_zerompi.py", "2-overlap", 2),
    Row("zerompi-2-ov-test", "zerompi stage 2, overlap + MPI_Test", "run_zerompi.py", "2-overlap-test", 2),
    Row("zerompi-2-ov-thread", "zerompi stage 2, overlap + communication thread", "run_zerompi.py",
        "2-overlap-thread", 2),
    Row("zerompi-2-ov-async", "zerompi stage 2, overlap + MPICH async progress", "run_zerompi.py", "2-overlap", 2,
        (("MPIR_CVAR_ASYNC_PROGRESS", "1"),)),
    Row("zerompi-3-pf", "zerompi stage 3, overlap + prefetch 1", "run_zerompi.py", "3-overlap", 3),
    Row("zerompi-3-pf-test", "zerompi stage 3, overlap + prefetch 1 + MPI_Test", "run_zerompi.py",
        "3-overlap-test", 3),
    Row("zerompi-3-pf-thread", "zerompi stage 3, overlap + prefetch 1 + communication thread", "run_zerompi.py",
        "3-overlap-thread", 3),
    Row("zerompi-3-pf-async", "zerompi stage 3, overlap + prefetch 1 + MPICH async progress", "run_zerompi.py",
        "3-overlap", 3, (("MPIR_CVAR_ASYNC_PROGRESS", "1"),)),
    Row("ddp", "DDP", "run_ddp.py", "ddp", 2),
    Row("ddp-zero-opt", "DDP + ZeroRedundancyOptimizer", "run_ddp.py", "zero_opt", 2),
    Row("fsdp2", "FSDP2 (reshard after forward)", "run_fsdp.py", "reshard", 3),
    Row("fsdp2-keep", "FSDP2 (no reshard after forward)", "run_fsdp.py", "noreshard", 2),
    Row("ds-1", "DeepSpeed ZeRO-1", "run_deepspeed.py", "1", 2),
    Row("ds-2", "DeepSpeed ZeRO-2", "run_deepspeed.py", "2", 2),
    Row("ds-3", "DeepSpeed ZeRO-3", "run_deepspeed.py", "3", 3),
]
MPICH_YIELD = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_POSIX_POLL_FREQUENCY": "1"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="20M,120M", help="comma list of 20M, 120M")
    p.add_argument("--np", default="2,4", help="comma list of world sizes")
    p.add_argument("--cases", help="comma list of SIZE:NP (e.g. 20M:2,20M:4,120M:2), instead of --sizes x --np")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved repeats of the whole list of rows, each repeat its own job per row")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", default="all", help="comma list of row keys: " + ",".join(r.key for r in ROWS))
    p.add_argument("--quick", action="store_true",
                   help="20M at np 2, 3 timed steps after 1 warm-up, results in peers-quick.*")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per row before it is killed")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="zerompi bucket_mb and DDP bucket_cap_mb")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out", help="results prefix (default benchmarks/results/peers or peers-quick)")
    p.add_argument("--mpiexec", help="default: the one next to this Python, else $ZEROMPI_MPIEXEC, else PATH")
    p.add_argument("--mpich-yield", action="store_true",
                   help="let waiting MPICH ranks yield the core (" + " ".join(MPICH_YIELD) + ")")
    p.add_argument("--reading", help="a markdown file with the reading of these results, put in the report")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite the report and plots from the existing {out}.jsonl")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.np, args.steps, args.warmup = "20M", "2", 3, 1
    args.out = Path(args.out or HERE / "results" / ("peers-quick" if args.quick else "peers"))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.cases and not args.quick:
        try:
            args.case_list = [(s, int(n)) for s, n in (c.split(":") for c in args.cases.split(","))]
        except ValueError:
            p.error(f"--cases: expected SIZE:NP,..., got {args.cases!r}")
    else:
        args.case_list = [(s, int(n)) for s in args.sizes.split(",") for n in args.np.split(",")]
    keys = [r.key for r in ROWS]
    wanted = keys if args.rows == "all" else args.rows.split(",")
    unknown = sorted(set(wanted) - set(keys))
    if unknown:
        p.error(f"unknown rows {unknown}; known: {keys}")
    args.row_list = [r for r in ROWS if r.key in wanted]
    return args


def find_mpiexec(explicit: str | None) -> str:
    for cand in (explicit, str(Path(sys.executable).parent / "mpiexec"), os.environ.get("ZEROMPI_MPIEXEC"),
                 shutil.which("mpiexec")):
        if cand and Path(cand).exists():
            return cand
    raise SystemExit("no mpiexec found: run benchmarks/setup_peers.sh or pass --mpiexec")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    return next((ln.strip() for ln in out.splitlines() if ln.strip()), "?")


def machine_meta(args, mpiexec: str) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
               if ln.startswith("MemTotal"))
    return dict(
        kind="meta", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), cpu=cpu, cores=len(os.sched_getaffinity(0)), mem_bytes=mem,
        os=platform.platform(), python=platform.python_version(),
        versions={d: _version(d) for d in ("torch", "deepspeed", "mpi4py", "mpich", "zerompi", "numpy")},
        mpi=" ".join(_first_line([str(Path(mpiexec).parent / "mpichversion")]).split()),
        zerompi_commit=_first_line(["git", "rev-parse", "--short", "HEAD"]),
        settings=dict(sizes=args.sizes, np=args.np, cases=[f"{s}:{n}" for s, n in args.case_list],
                      repeats=args.repeats, steps=args.steps, warmup=args.warmup, micro_batch=4,
                      seq=256, lr=3e-4, weight_decay=0.01, dtype="fp32", threads_per_rank=1,
                      bucket_mb=args.bucket_mb, seed=args.seed, mpich_yield=args.mpich_yield,
                      timeout_s=args.timeout),
        loadavg_start=os.getloadavg())


def _error_tail(text: str, lines: int = 6) -> str:
    noise = ("Warning", "warnings.warn", "return func(", "built successfully")
    keep = [ln for ln in text.splitlines() if ln.strip() and not any(n in ln for n in noise)]
    return "\n".join(keep[-lines:])[-1500:]


def job_env(args, extra: tuple[tuple[str, str], ...] = ()) -> dict:
    """The environment of one job: one thread per rank, gloo's rendezvous on 127.0.0.1 at a free port."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
               PYTHONWARNINGS="ignore::FutureWarning")
    if args.mpich_yield:
        env.update(MPICH_YIELD)
    env.update(extra)
    return env


def run_job(cmd: list[str], env: dict, timeout: float) -> tuple[str, str, int | None]:
    """Run one mpiexec job in its own process group: (status ok/failed/timeout, its output, exit code).

    A job past ``timeout`` seconds gets SIGTERM, then SIGKILL, to its whole group (mpiexec and its ranks).
    """
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        return ("ok" if proc.returncode == 0 else "failed"), log or "", proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            log, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        return "timeout", log or "", proc.returncode


def job_error(status: str, log: str, code: int | None, timeout: float) -> str:
    return (f"timed out after {timeout:.0f} s\n" if status == "timeout" else f"exit code {code}\n") + _error_tail(log)


def run_row(row: Row, size: str, np_: int, args, mpiexec: str, prefix: tuple[str, ...] = (),
            extra: tuple[str, ...] = ()) -> dict:
    """One row as its own mpiexec job; the row's result, or its failure.

    ``prefix``: a command each rank runs the row's Python under (e.g. a profiler); ``extra``:
    more arguments of the row's script (``--trace``).
    """
    out = Path(tempfile.mkstemp(prefix=f"peer-{row.key}-", suffix=".json")[1])
    cmd = [mpiexec, "-n", str(np_), *prefix, sys.executable, "-m", "mpi4py", str(HERE / "peers" / row.runner),
           "--size", size, "--variant", row.variant, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--bucket-mb", str(args.bucket_mb), "--seed", str(args.seed), "--out", str(out), *extra]
    base = dict(kind="row", row=row.key, label=row.label, size=size, np=np_, ideal_psi=row.ideal_psi,
                loadavg_before=os.getloadavg())
    t0 = time.perf_counter()
    status, log, code = run_job(cmd, job_env(args, row.env), args.timeout)
    base.update(wall_s=time.perf_counter() - t0, loadavg_after=os.getloadavg(), status=status)
    try:
        if status == "ok":
            base.update(json.loads(out.read_text()))
    except (OSError, ValueError) as e:
        base.update(status="failed", error=f"no result file: {e}")
    finally:
        out.unlink(missing_ok=True)
    if status != "ok":
        base["error"] = job_error(status, log, code, args.timeout)
    return base


def write_report(meta: dict, results: list[dict], args) -> None:
    reading = Path(args.reading).read_text() if args.reading else None
    md = args.out.with_suffix(".md")
    md.write_text(report.markdown(meta, results, reading))
    written = plots.write(rp.fold(results), args.out)
    print(f"wrote {md}" + "".join(f", {p}" for p in written))


def main(argv=None) -> None:
    args = parse_args(argv)
    jsonl = args.out.with_suffix(".jsonl")
    if args.report_only:
        lines = [json.loads(ln) for ln in jsonl.read_text().splitlines() if ln.strip()]
        metas = [ln for ln in lines if ln["kind"] in ("meta", "meta_end")]  # meta_end adds the end load
        write_report(dict(metas[-1], kind="meta"), [r for r in lines if r["kind"] == "row"], args)
        return
    mpiexec = find_mpiexec(args.mpiexec)
    meta = machine_meta(args, mpiexec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with open(jsonl, "w") as f:
        f.write(json.dumps(meta) + "\n")
        for repeat in range(args.repeats):  # round robin: every row's repeat k before any row's k+1
            for size, np_ in args.case_list:
                for row in args.row_list:
                    r = dict(run_row(row, size, np_, args, mpiexec), repeat=repeat)
                    results.append(r)
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    shown = f"{r['step_s_median']:.2f} s/step" if r["status"] == "ok" else r["error"].splitlines()[0]
                    print(f"repeat {repeat + 1}/{args.repeats} {size} np={np_} {row.label:34s} {r['status']:7s} "
                          f"{shown} ({r['wall_s']:.0f} s)", flush=True)
        meta["loadavg_end"] = os.getloadavg()
        f.write(json.dumps(dict(meta, kind="meta_end")) + "\n")
    write_report(meta, results, args)


if __name__ == "__main__":
    main()
