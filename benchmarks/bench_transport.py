"""The collectives of one training step of each row, timed on MPICH shared memory and on gloo over TCP.

zerompi's collectives run on MPI (MPICH: shared memory between the ranks of one node); the
torch.distributed and DeepSpeed rows of bench_peers.py run on gloo over TCP loopback. This
separates the two: it records every collective a row issues in one timed step (calltrace.py:
op, size, function), then replays each row's list alone, blocking, on both transports at the
same world size, so a step-time gap between zerompi and a peer can be split into transport
(the peer's calls on gloo against the same calls on MPICH) and pattern (the peer's calls
against zerompi's, both on MPICH).

    benchmarks/.venv-peers/bin/python benchmarks/bench_transport.py [--np 2,4] [--repeats 3] \\
        [--rows zerompi-1,zerompi-2,zerompi-3,ddp,fsdp2,ds-3] [--peers benchmarks/results/peers-repeats]

1. trace: each row runs once per world size (1 warm-up + 1 traced step) with ``--trace``.
2. time: for each repeat, world size and transport (alternating which transport goes first),
   one mpiexec job (peers/transport_worker.py) replays every row's calls ``--warmup`` + ``--iters``
   times; the repeats are interleaved, so a drifting machine hits both transports alike.

Results: ``benchmarks/results/transport.{jsonl,md}`` (``--out``); ``--peers PREFIX`` adds the gap
table from a bench_peers.py run's ``PREFIX.jsonl``; ``--report-only`` rewrites the md from the jsonl.

``--lora``: the rows of bench_lora_steps.py instead (default zerompi stage 3 and DeepSpeed ZeRO-3 with
its defaults, on the LoRA base at ``--n-layer`` layers, 2 ranks), traced by workers/lora_worker.py;
results ``benchmarks/results/transport-lora.{jsonl,md}``, gap against ``benchmarks/results/lora_steps``.
``--with-steps`` also times each row's steps as bench_lora_steps.py does (1 untimed + 4 timed steps),
once per repeat before its replay jobs, so that step times and replays see the same machine; the
report then adds a gap table from those step jobs.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_lora_steps  # noqa: E402
import bench_peers  # noqa: E402
from harness import launch, markdown, paths, repeats, rows, stamp  # noqa: E402
from harness import summary as rp  # noqa: E402
from peers import transport_report  # noqa: E402

DEFAULT_ROWS = "zerompi-1,zerompi-2,zerompi-3,ddp,fsdp2,ds-3"
LORA_ROWS = "stage3,deepspeed-zero3"


class LoraRow(NamedTuple):
    """A bench_lora_steps.py row, named as bench_peers' rows are."""
    key: str
    label: str


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="20M", choices=("20M", "120M"))
    p.add_argument("--np", help="comma list of world sizes (default 2,4; with --lora 2)")
    p.add_argument("--rows", help=f"row keys of bench_peers.py (default {DEFAULT_ROWS}) or with --lora of "
                                  f"bench_lora_steps.py (default {LORA_ROWS})")
    p.add_argument("--lora", action="store_true", help="the LoRA rows of bench_lora_steps.py")
    p.add_argument("--n-layer", type=int, default=4, help="--lora: depth of the base, as bench_lora_steps.py")
    p.add_argument("--with-steps", action="store_true",
                   help="--lora: time the rows' steps too, in every repeat beside the replays (a gap table of its own)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every (world size, transport) job")
    p.add_argument("--iters", type=int, default=5, help="timed replays of a row's step per job")
    p.add_argument("--warmup", type=int, default=1, help="untimed replays first")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="as in bench_peers.py (zerompi bucket_mb, DDP's cap)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--mpich-yield", action="store_true", help="let waiting MPICH ranks yield the core")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="2 ranks, 2 repeats of 2 iterations: a check")
    p.add_argument("--out", help="results prefix (default benchmarks/results/transport)")
    p.add_argument("--peers", help="prefix of a bench_peers.py (--lora: bench_lora_steps.py) run, its .jsonl, for "
                                   "the step-gap table; a comma list gives one table per run")
    p.add_argument("--mpiexec")
    p.add_argument("--reading", help="a markdown file with the reading, put in the report")
    p.add_argument("--report-only", action="store_true", help="run nothing: rewrite the md from {out}.jsonl")
    args = p.parse_args(argv)
    if args.quick:
        args.np, args.repeats, args.iters = "2", 2, 2
    args.out = Path(args.out or HERE / "results" / ("transport-lora" if args.lora else "transport"))
    args.np = args.np or ("2" if args.lora else "2,4")
    args.rows = args.rows or (LORA_ROWS if args.lora else DEFAULT_ROWS)
    if args.with_steps and not args.lora:
        p.error("--with-steps needs --lora")
    if args.lora:
        args.size = f"{args.n_layer} layers"  # bench_lora_steps' records call their size so
        args.peers = args.peers or str(HERE / "results" / "lora_steps")
    keys = ({k: LoraRow(key=k, label=label) for k, (label, _) in bench_lora_steps.ROWS.items()} if args.lora
            else {r.key: r for r in bench_peers.ROWS})
    unknown = [k for k in args.rows.split(",") if k not in keys]
    if unknown:
        p.error(f"unknown rows {unknown}")
    args.row_list = [keys[k] for k in args.rows.split(",")]
    args.np_list = [int(n) for n in args.np.split(",")]
    return args


def meta_of(args, mpiexec: str) -> dict:
    shim = argparse.Namespace(sizes=args.size, np=args.np, case_list=[], repeats=args.repeats, steps=1, warmup=1,
                              bucket_mb=args.bucket_mb, seed=args.seed, mpich_yield=args.mpich_yield,
                              timeout=args.timeout)
    meta = bench_peers.machine_meta(shim, mpiexec)
    meta["gloo_host_address"] = socket.gethostbyname(socket.gethostname())  # gloo's default device binds here
    meta["settings"] = dict(size=args.size, np=args.np, rows=args.rows, repeats=args.repeats, iters=args.iters,
                            warmup=args.warmup, trace_warmup=1, bucket_mb=args.bucket_mb, seed=args.seed,
                            mpich_yield=args.mpich_yield, lora=args.lora, with_steps=args.with_steps)
    if args.lora:
        m = bench_lora_steps.LORA.model
        meta["settings"].update(bucket_mb=None, model=(
            f"LoRA base of bench_lora_steps.py: Llama-style, {args.n_layer} layers, hidden {m['hidden']}, "
            f"intermediate {m['intermediate']}, vocabulary {m['vocab']}, bf16, LoRA r={m['lora_r']}, "
            f"{m['seq']} tokens per rank"))
        meta["dirty"] = stamp.dirty((*bench_lora_steps.SOURCES, "benchmarks/bench_transport.py",
                                     "benchmarks/peers/transport_worker.py"))
    return meta


def lora_args(args, np_: int, steps: int, warmup: int) -> argparse.Namespace:
    return argparse.Namespace(ranks=np_, n_layer=args.n_layer, seq=bench_lora_steps.LORA.model["seq"], steps=steps,
                              warmup=warmup, timeout=args.timeout, mpich_yield=args.mpich_yield)


def trace_job(row, np_: int, args, mpiexec: str) -> dict:
    """One traced run of a row: 1 warm-up + 1 traced step (bench_peers' or bench_lora_steps' worker)."""
    if args.lora:
        return bench_lora_steps.run_row(row.key, lora_args(args, np_, 1, 1), mpiexec, extra=("--trace",))
    targs = argparse.Namespace(steps=1, warmup=1, bucket_mb=args.bucket_mb, seed=args.seed, timeout=args.timeout,
                               mpich_yield=args.mpich_yield)
    return bench_peers.run_row(row, args.size, np_, targs, mpiexec, extra=("--trace",))


def trace_rows(args, mpiexec: str, log: rows.RowLog) -> list[dict]:
    """Each row once per world size with --trace: the collectives of one timed step."""
    traces = []
    for np_ in args.np_list:
        for row in args.row_list:
            r = trace_job(row, np_, args, mpiexec)
            t = dict(kind="trace", row=row.key, label=row.label, size=args.size, np=np_, status=r["status"],
                     calls=r.get("trace", []), params=r.get("params"),
                     bytes_per_step_kinds=r.get("bytes_per_step_kinds"), error=r.get("error", ""))
            if r["status"] == "ok" and not t["calls"]:
                t.update(status="failed", error="no calls traced")
            traces.append(log.add(t))
            print(f"trace np={np_} {row.label:34s} {t['status']:7s} {len(t['calls'])} calls", flush=True)
    return traces


def time_job(transport: str, np_: int, repeat: int, plan: Path, args, mpiexec: str) -> dict:
    res = Path(tempfile.mkstemp(prefix=f"transport-{transport}-", suffix=".json")[1])
    cmd = launch.mpi_command(np_, HERE / "peers" / "transport_worker.py", "--transport", transport, "--plan", plan,
                             "--iters", args.iters, "--warmup", args.warmup, "--out", res, mpiexec=mpiexec)
    try:
        outcome, result = launch.run_json(cmd, res, bench_peers.job_env(args), args.timeout)
    finally:
        res.unlink(missing_ok=True)
    return dict(kind="time", transport=transport, np=np_, repeat=repeat, **outcome.record(),
                **({"rows": result} if result is not None else {}))


def load_peers(prefixes: str | None) -> list[dict]:
    """Each step-time run named in ``--peers`` (comma list): its file, last meta line and folded rows."""
    runs = []
    for prefix in (prefixes or "").split(","):
        if not prefix:
            continue
        path = Path(prefix).with_suffix(".jsonl")
        meta, found = rows.split(rows.read(path))
        runs.append(dict(name=paths.shown(path), meta=meta, rows=rp.fold(found)))
    return runs


def step_jobs(repeat: int, args, mpiexec: str, log: rows.RowLog) -> list[dict]:
    """--with-steps: one step-time job per row (as bench_lora_steps.py times them), written as its rows."""
    steps = []
    for np_ in args.np_list:
        for row in args.row_list:
            r = log.add(dict(bench_lora_steps.run_row(row.key, lora_args(args, np_, 4, 1), mpiexec), repeat=repeat))
            steps.append(r)
            print(f"repeat {repeat + 1}/{args.repeats} np={np_} steps {row.label:30s} {r['status']:7s} "
                  f"{repeats.shown_step(r)}", flush=True)
    return steps


def time_jobs(repeat: int, plans: dict, args, mpiexec: str, log: rows.RowLog) -> list[dict]:
    """One repeat of the replay jobs: per world size both transports, which goes first alternating."""
    times = []
    for np_ in args.np_list:
        for transport in (("mpi", "gloo") if repeat % 2 == 0 else ("gloo", "mpi")):
            t = log.add(time_job(transport, np_, repeat, plans[np_], args, mpiexec))
            times.append(t)
            shown = ", ".join(f"{k} {v['median']:.3f}" for k, v in t.get("rows", {}).items()) or \
                t.get("error", "").splitlines()[0]
            print(f"repeat {repeat + 1}/{args.repeats} np={np_} {transport:4s} {t['status']:7s} {shown} "
                  f"({t['wall_s']:.0f} s)", flush=True)
    return times


def write_report(meta: dict, traces: list[dict], times: list[dict], args, steps: list[dict] = ()) -> None:
    md = args.out.with_suffix(".md")
    runs = load_peers(args.peers)
    if steps:
        runs.append(dict(name=f"{md.with_suffix('.jsonl').name}: the step jobs of each repeat", meta=meta,
                         rows=rp.fold(list(steps))))
    markdown.write(md, transport_report.markdown(meta, traces, times, runs, markdown.reading(args.reading)))


def measure(args, mpiexec: str, log: rows.RowLog) -> tuple[list, list, list]:
    """Trace every row, then the interleaved repeats of the replay jobs (and, --with-steps, the step jobs)."""
    traces, times, steps = trace_rows(args, mpiexec, log), [], []
    with tempfile.TemporaryDirectory() as tmp:
        plans = {}
        for np_ in args.np_list:
            plans[np_] = Path(tmp) / f"plan-{np_}.json"
            plans[np_].write_text(json.dumps({t["row"]: t["calls"] for t in traces
                                              if t["np"] == np_ and t["status"] == "ok"}))
        for repeat in range(args.repeats):
            if args.with_steps:
                steps += step_jobs(repeat, args, mpiexec, log)
            times += time_jobs(repeat, plans, args, mpiexec, log)
    return traces, times, steps


def main(argv=None) -> None:
    args = parse_args(argv)
    jsonl = args.out.with_suffix(".jsonl")
    if args.report_only:
        lines = rows.read(jsonl)
        meta, steps = rows.split(lines)
        write_report(meta, [t for t in lines if t["kind"] == "trace"], [t for t in lines if t["kind"] == "time"],
                     args, steps)
        return
    mpiexec = launch.find_mpiexec(args.mpiexec)
    with rows.RowLog(jsonl, meta_of(args, mpiexec)) as log:
        traces, times, steps = measure(args, mpiexec, log)
    write_report(log.meta, traces, times, args, steps)


if __name__ == "__main__":
    main()
