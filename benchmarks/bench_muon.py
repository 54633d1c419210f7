"""What Muon costs: zerompi's Muon + AdamW beside its AdamW and beside DeepSpeed's Muon, at stages 2 and 3.

Every row trains bench_peers' GPT (20M: 6 layers x d512 x 8 heads, vocab 256, block 256, tied
embeddings) from the same initial weights on the same data (micro-batch 4 per rank, sequence 256,
fp32, one torch thread per rank) as its own ``mpiexec`` job, rows interleaved over ``--repeats``:

- ``z{2,3}-adamw``: zerompi, AdamW on every parameter (bench_peers' zerompi rows);
- ``z{2,3}-muon``: zerompi, torch.optim.Muon on the hidden matrices in a param group of its own
  (owner-aligned buckets), AdamW on the rest (peers/muonlib.py has the split);
- ``ds{2,3}-muon``: DeepSpeed 0.19.8's ``"optimizer": {"type": "Muon"}`` on the same split;
- ``ds{2,3}-adamw``: DeepSpeed with torch's AdamW (bench_peers' DeepSpeed rows), to set DeepSpeed's
  Muon beside DeepSpeed's own AdamW.

Per row: step time (median of repeats, with their spread), bytes one rank sends per step by
collective kind (zerompi's counters; DeepSpeed's torch.distributed calls counted, peers/commcount.py),
optimizer-state bytes on every rank, and for Muon rows the load balance: the largest rank's Muon
state over the mean.

    benchmarks/.venv-peers/bin/python benchmarks/bench_muon.py [--repeats 3] [--steps 3] [--warmup 1]
        [--rows z2-adamw,z2-muon,...] [--out benchmarks/results/muon_cost]

Results: ``benchmarks/results/muon_cost.{jsonl,md}``.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, repeats, rows, stamp
from peers import muon_report


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    runner: str      # script under benchmarks/peers/
    variant: str     # STAGE-OPTIMIZER
    framework: str   # zerompi or deepspeed


ROWS = [Row(f"{fk}{s}-{opt}", f"{fw} stage {s}, {name}", runner, f"{s}-{opt}", fw)
        for s in (2, 3)
        for fk, fw, runner in (("z", "zerompi", "run_zerompi_muon.py"), ("ds", "deepspeed", "run_deepspeed_muon.py"))
        for opt, name in (("adamw", "AdamW"), ("muon", "Muon + AdamW"))]
DEFAULT_ROWS = "z2-adamw,z2-muon,ds2-adamw,ds2-muon,z3-adamw,z3-muon,ds3-adamw,ds3-muon"
PEER_ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore::FutureWarning"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="20M", choices=("20M", "120M"))
    p.add_argument("--np", type=int, default=2, help="world size")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats, each its own job per row")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma list of: " + ",".join(r.key for r in ROWS))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per row before it is killed")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="zerompi bucket_mb")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-mpich-yield", dest="mpich_yield", action="store_false",
                   help="MPICH ranks busy-poll while waiting (default: they yield the core)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "muon_cost", help="results prefix")
    p.add_argument("--reading", help="a markdown file with the reading of these results, put in the report")
    p.add_argument("--report-only", action="store_true", help="run nothing: rewrite the report from OUT.jsonl")
    args = p.parse_args(argv)
    by_key = {r.key: r for r in ROWS}
    unknown = sorted(set(args.rows.split(",")) - set(by_key))
    if unknown or args.repeats < 1:
        p.error(f"unknown rows {unknown}; known: {list(by_key)}" if unknown else "--repeats must be at least 1")
    args.row_list = [by_key[k] for k in args.rows.split(",")]
    return args


def meta_of(args, mpiexec: str) -> dict:
    m, v = stamp.machine(), stamp.versions(("deepspeed", "mpich", "numpy"))
    return dict(
        date=stamp.utc_now(), host=m["host"], cpu=m["cpu"], cores=m["cpus_usable"], mem_gib=m["mem_gib"],
        os=m["os"], python=v["python"], versions={d: v[d] for d in ("torch", "deepspeed", "mpi4py", "zerompi")},
        mpi=v["mpi"] or "?", mpiexec=mpiexec, commit=stamp.commit(short=True),
        settings=dict(size=args.size, np=args.np, rows=[r.key for r in args.row_list], repeats=args.repeats,
                      steps=args.steps, warmup=args.warmup, micro_batch=4, seq=256, lr=3e-4, weight_decay=0.01,
                      muon_lr=0.02, momentum=0.95, dtype="fp32", threads_per_rank=1, bucket_mb=args.bucket_mb,
                      seed=args.seed, mpich_yield=args.mpich_yield, timeout_s=args.timeout),
        loadavg_start=stamp.loadavg())


def run_row(row: Row, args, mpiexec: str) -> dict:
    """One row as its own mpiexec job: its result, or its failure with the end of its output."""
    out = Path(tempfile.mkstemp(prefix=f"muon-{row.key}-", suffix=".json")[1])
    cmd = launch.mpi_command(args.np, HERE / "peers" / row.runner, "--size", args.size, "--variant", row.variant,
                             "--steps", args.steps, "--warmup", args.warmup, "--bucket-mb", args.bucket_mb,
                             "--seed", args.seed, "--out", out, mpiexec=mpiexec)
    env = launch.job_env(args.mpich_yield, rendezvous=True, extra=tuple(PEER_ENV.items()))
    base = dict(row=row.key, label=row.label, framework=row.framework, stage=int(row.variant[0]),
                optimizer=row.variant.split("-")[1], size=args.size, np=args.np)
    try:
        outcome, result = launch.run_json(cmd, out, env, args.timeout)
    finally:
        out.unlink(missing_ok=True)
    return dict(base, **outcome.record(), **(result or {}))


def main(argv=None) -> None:
    args = parse_args(argv)
    jsonl = args.out.with_suffix(".jsonl")
    if args.report_only:
        meta, results = rows.split(rows.read(jsonl))
    else:
        mpiexec = launch.find_mpiexec()
        with rows.RowLog(jsonl, meta_of(args, mpiexec)) as log:
            results = repeats.run(args.row_list, args.repeats, lambda row, _: run_row(row, args, mpiexec), log,
                                  show=lambda r: f"{r['label']:34s} {r['status']:7s} {repeats.shown_step(r)} "
                                                 f"({r['wall_s']:.0f} s, load {r['loadavg_before'][0]:.1f})")
        meta = log.meta
    markdown.write(args.out.with_suffix(".md"),
                   muon_report.markdown(meta, results, markdown.reading(args.reading), jsonl))


if __name__ == "__main__":
    main()
