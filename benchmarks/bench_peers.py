"""zerompi stages 0-3 beside DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, in one run.

Every row trains the same GPT from the same initial weights on the same data
(micro-batch 4 per rank, sequence 256, fp32 AdamW lr 3e-4 wd 0.01, one torch
thread per rank) as its own ``mpiexec`` job with a timeout; the torch.distributed
rows rendezvous over gloo on 127.0.0.1 with rank and size from MPI. A row that
fails or times out is recorded with its error and the run goes on.

The whole list of rows runs ``--repeats`` times (default 3), interleaved: repeat 1 of every
row, then repeat 2 of every row, and so on, so that a drifting machine hits every row alike.
The report gives each row's median over repeats, their spread, and ratios with the range
the spreads allow ("at parity" where it contains 1.0; harness/summary.py).

    benchmarks/.venv-peers/bin/python benchmarks/bench_peers.py \
        [--sizes 20M,120M] [--np 2,4] [--cases 20M:2,120M:2] [--repeats 3] [--steps N]
        [--rows zerompi-3,ddp,...] [--quick]

Set up the venv first: ``bash benchmarks/setup_peers.sh``. Results go to
``benchmarks/results/peers.{md,jsonl}`` and ``peers-time.png`` / ``peers-memory.png``
(``--quick``: ``peers-quick.*``); see benchmarks/README.md for the columns.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, repeats, rows, stamp, summary  # noqa: E402
from peers import plots, report  # noqa: E402


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
MPICH_YIELD = launch.MPICH_YIELD
# every row's job: DeepSpeed on CPU, and no FutureWarnings of the peers' in the rows' output
PEER_ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore::FutureWarning"}


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


def machine_meta(args, mpiexec: str) -> dict:
    """The run's meta line: the machine and versions as the report's header reads them, and the settings."""
    m, v = stamp.machine(), stamp.versions(("deepspeed", "mpich", "numpy"))
    return dict(
        date=stamp.utc_now(), host=m["host"], cpu=m["cpu"], cores=m["cpus_usable"],
        mem_bytes=int(m["mem_gib"] * stamp.GiB), os=m["os"], python=v["python"],
        versions={d: v[d] for d in ("torch", "deepspeed", "mpi4py", "mpich", "zerompi", "numpy")},
        mpi=v["mpi"] or "?", mpiexec=mpiexec, zerompi_commit=stamp.commit(short=True),
        settings=dict(sizes=args.sizes, np=args.np, cases=[f"{s}:{n}" for s, n in args.case_list],
                      repeats=args.repeats, steps=args.steps, warmup=args.warmup, micro_batch=4,
                      seq=256, lr=3e-4, weight_decay=0.01, dtype="fp32", threads_per_rank=1,
                      bucket_mb=args.bucket_mb, seed=args.seed, mpich_yield=args.mpich_yield,
                      timeout_s=args.timeout),
        loadavg_start=stamp.loadavg())


def job_env(args, extra: tuple[tuple[str, str], ...] = ()) -> dict:
    """The environment of one row's job: gloo's rendezvous on 127.0.0.1 at a free port, DeepSpeed on CPU."""
    return launch.job_env(args.mpich_yield, rendezvous=True,
                          extra=(*PEER_ENV.items(), *extra))


def run_row(row: Row, size: str, np_: int, args, mpiexec: str, prefix: tuple[str, ...] = (),
            extra: tuple[str, ...] = ()) -> dict:
    """One row as its own mpiexec job; the row's result, or its failure.

    ``prefix``: a command each rank runs the row's Python under (e.g. a profiler); ``extra``:
    more arguments of the row's script (``--trace``).
    """
    out = Path(tempfile.mkstemp(prefix=f"peer-{row.key}-", suffix=".json")[1])
    cmd = launch.mpi_command(np_, HERE / "peers" / row.runner, "--size", size, "--variant", row.variant,
                             "--steps", args.steps, "--warmup", args.warmup, "--bucket-mb", args.bucket_mb,
                             "--seed", args.seed, "--out", out, *extra, mpiexec=mpiexec, prefix=tuple(prefix))
    base = dict(row=row.key, label=row.label, size=size, np=np_, ideal_psi=row.ideal_psi)
    try:
        outcome, result = launch.run_json(cmd, out, job_env(args, row.env), args.timeout)
    finally:
        out.unlink(missing_ok=True)
    return dict(base, **outcome.record(), **(result or {}))


def write_report(meta: dict, results: list[dict], args) -> None:
    markdown.write(args.out.with_suffix(".md"), report.markdown(meta, results, markdown.reading(args.reading)))
    for path in plots.write(summary.fold(results), args.out):
        print(f"wrote {path}")


def main(argv=None) -> None:
    args = parse_args(argv)
    jsonl = args.out.with_suffix(".jsonl")
    if args.report_only:
        write_report(*rows.split(rows.read(jsonl)), args)
        return
    mpiexec = launch.find_mpiexec(args.mpiexec)
    cases = [(size, np_, row) for size, np_ in args.case_list for row in args.row_list]
    with rows.RowLog(jsonl, machine_meta(args, mpiexec)) as log:
        results = repeats.run(cases, args.repeats, lambda case, _: run_row(case[2], *case[:2], args, mpiexec), log,
                              show=lambda r: f"{r['size']} np={r['np']} {r['label']:34s} {r['status']:7s} "
                                             f"{repeats.shown_step(r)} ({r['wall_s']:.0f} s)")
    write_report(log.meta, results, args)


if __name__ == "__main__":
    main()
