"""Step time of LoRA fine-tuning: zerompi stage 3 beside DeepSpeed ZeRO-3 on the same PEFT model.

    benchmarks/.venv-peers/bin/python benchmarks/bench_lora_steps.py [--n-layer 4] [--repeats 5]
        [--steps 4] [--warmup 1] [--rows stage3,deepspeed-zero3] [--reading NOTE.md] [--report-only]

Every repeat of every row is its own ``mpiexec`` job of workers/lora_worker.py (the Llama-style
frozen base of the LoRA capacity ladder at ``--n-layer`` layers, bf16, LoRA r=8, one sequence of
``--seq`` tokens per rank, one torch thread per rank), each with a timeout. The rows alternate
(repeat 1 of every row, then repeat 2, ...), so a drifting or shared machine slows them alike. A
repeat's step time is the median over its timed steps of the slowest rank's step; a row's is the
median of its repeats, with their min-max spread; the ratio's range is what the two spreads allow,
"at parity" where it contains 1.0 (peers/repeats.py). Run it with the peers venv's Python
(benchmarks/setup_peers.sh: DeepSpeed, transformers, peft). Results, all generated:
benchmarks/results/lora_steps.{jsonl,md}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers")]
from bench_peers import job_env  # noqa: E402
from harness import launch, markdown, paths, repeats, rows, stamp  # noqa: E402
from harness import summary as rp  # noqa: E402
from lora_report import LORA  # noqa: E402

ROWS = {  # row key: what the report calls it, and what its collectives go through
    "stage3": ("zerompi stage 3", "MPI (MPICH shared memory)"),
    "stage3-lean": ("zerompi stage 3, return_freed_memory", "MPI (MPICH shared memory)"),
    "stage0": ("zerompi stage 0", "MPI (MPICH shared memory)"),
    "deepspeed-zero3": ("DeepSpeed ZeRO-3 (defaults)", "torch.distributed gloo over TCP loopback"),
    "deepspeed-zero3-lean": ("DeepSpeed ZeRO-3 (lean)", "torch.distributed gloo over TCP loopback"),
}
SOURCES = ("zerompi", "benchmarks/bench_lora_steps.py", "benchmarks/workers/lora_worker.py",
           "jobs/finetune_lora.py", "benchmarks/harness")
OURS, THEIRS = "stage3", "deepspeed-zero3"  # the target: ours <= 1.0x theirs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4, help="depth of the base (a size every row fits)")
    p.add_argument("--seq", type=int, default=LORA.model["seq"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed steps per job (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rows", default=f"{OURS},{THEIRS}", help="comma list of " + ", ".join(ROWS))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per job before it is killed")
    p.add_argument("--mpich-yield", action="store_true", help="let waiting MPICH ranks yield the core")
    p.add_argument("--out", type=Path, default=HERE / "results" / "lora_steps", help="results prefix")
    p.add_argument("--reading", type=Path, help="a markdown note put in the report")
    p.add_argument("--report-only", action="store_true", help="rewrite the md from the existing jsonl")
    args = p.parse_args(argv)
    args.row_list = args.rows.split(",")
    if unknown := [r for r in args.row_list if r not in ROWS]:
        p.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def run_row(row: str, args, mpiexec: str, extra: tuple[str, ...] = ()) -> dict:
    """One repeat of one row as its own job: the record harness.summary.fold expects (``extra``: more
    worker arguments, e.g. bench_transport's ``--trace``)."""
    out = Path(tempfile.mkstemp(prefix=f"lora-{row}-", suffix=".json")[1])
    nvme = Path(tempfile.mkdtemp(prefix="lora-swap-"))
    model = [a for k, v in {**LORA.model, "seq": args.seq}.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    cmd = launch.mpi_command(args.ranks, HERE / "workers" / "lora_worker.py", "--mode", row, "--n-layer",
                             args.n_layer, *model, "--steps", args.steps, "--warmup", args.warmup, "--nvme", nvme,
                             "--out", out, *extra, mpiexec=mpiexec)
    rec = dict(row=row, label=ROWS[row][0], size=f"{args.n_layer} layers", np=args.ranks)
    try:
        outcome, r = launch.run_json(cmd, out, job_env(args), args.timeout)
    finally:
        out.unlink(missing_ok=True)
        os.rmdir(nvme) if nvme.exists() and not any(nvme.iterdir()) else None
    rec.update(outcome.record())
    if r is not None:
        steps = r["step_s"]
        rec.update(r, step_s_median=statistics.median(steps), step_s_min=min(steps), step_s_max=max(steps),
                   loss_final=r["losses"][-1], rss_peak_max=max(x["peak_rss"] for x in r["ranks"]),
                   rss_steady_max=max(x["rss_steady"] for x in r["ranks"]),
                   bytes_per_step=statistics.mean(sum(x["bytes_sent_per_step"].values()) for x in r["ranks"]))
    return rec


def meta_of(args, mpiexec: str, command: str) -> dict:
    return dict(date=stamp.utc_now(), command=command, commit=stamp.commit(short=True),
                dirty=stamp.dirty(SOURCES), machine=stamp.machine_line(), cores=stamp.machine()["cpus"],
                mpiexec=mpiexec,
                versions={d: stamp.version(d) for d in ("torch", "deepspeed", "transformers", "peft", "mpich",
                                                        "zerompi")},
                settings=dict(n_layer=args.n_layer, **{**LORA.model, "seq": args.seq}, ranks=args.ranks,
                              repeats=args.repeats, steps=args.steps, warmup=args.warmup, rows=args.row_list,
                              mpich_yield=args.mpich_yield, timeout_s=args.timeout),
                loadavg_start=stamp.loadavg())


def markdown_report(meta: dict, results: list[dict], reading: str | None) -> str:
    s, folded = meta["settings"], {r["row"]: r for r in rp.fold(results)}
    ok = next((r for r in results if r["status"] == "ok"), {})
    lines = ["# LoRA step time: zerompi stage 3 beside DeepSpeed ZeRO-3", "",
             f"Generated from `{Path(meta['out']).name}.jsonl` by `benchmarks/bench_lora_steps.py` at commit "
             f"{meta['commit']}{' + uncommitted changes to ' + ', '.join(meta['dirty']) if meta['dirty'] else ''}, "
             f"{meta['date']} (`{meta['command']}`).", "",
             f"Machine: {meta['machine']}; load average {meta['loadavg_start'][0]:.2f} at the start, "
             f"{meta.get('loadavg_end', [float('nan')])[0]:.2f} at the end. Versions: "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v) + ".", "",
             f"Model: the LoRA capacity ladder's Llama-style base at {s['n_layer']} layers (hidden {s['hidden']}, "
             f"intermediate {s['intermediate']}, {s['heads']} heads, {s['kv_heads']} key/value heads, vocabulary "
             f"{s['vocab']}" + (f"; {ok['params'] / 1e6:.0f}M frozen parameters, {ok['lora_params'] / 1e6:.2f}M "
                                 "LoRA" if ok else "") + f"), bf16, LoRA r={s['lora_r']} on all projections, "
             f"AdamW; one sequence of {s['seq']} tokens per rank, {s['ranks']} ranks, one torch thread per rank. "
             f"{s['repeats']} repeats per row, interleaved; each repeat {s['warmup']} untimed + {s['steps']} timed "
             "steps, every step started at a barrier and timed on its slowest rank.", "",
             "| row | collectives through | step s (median of repeats) | spread s | repeats | sent MB/step/rank "
             "| peak RSS MiB/rank | final loss |", "|---|---|---|---|---|---|---|---|"]
    for key in s["rows"]:
        r = folded.get(key)
        if r is None or not r.get("repeats_ok"):
            lines.append(f"| {ROWS[key][0]} | {ROWS[key][1]} | failed |  | 0 of {r['repeats'] if r else 0} |  |  |  |")
            continue
        lines.append(f"| {r['label']} | {ROWS[key][1]} | {r['step_s_median']:.2f} | {r['step_s_lo']:.2f}–"
                     f"{r['step_s_hi']:.2f} | {r['repeats_ok']} of {r['repeats']} | {r['bytes_per_step'] / 1e6:.0f} | "
                     f"{r['rss_peak_max'] / 2**20:.0f} | {r['loss_final']:.4f} |")
    lines += ["", "Per repeat (step s, in run order): " + "; ".join(
        f"{ROWS[k][0]}: " + ", ".join(f"{x:.2f}" for x in folded[k].get("step_s_repeats", [])) for k in s["rows"]
        if k in folded), ""]
    if OURS in folded and THEIRS in folded and folded[OURS].get("repeats_ok") and folded[THEIRS].get("repeats_ok"):
        ratio = rp.ratio(folded[OURS], folded[THEIRS])
        lines += [f"zerompi stage 3 / DeepSpeed ZeRO-3 step time: {rp.fmt_ratio(ratio)}; target ≤ 1.0×: "
                  f"{rp.target_verdict(ratio, 1.0)}.", ""]
    lines += ["What differs between the rows: the model, the data, the kernels of forward and backward (the same "
              "Hugging Face modules and torch bf16 CPU kernels) and the optimizer (torch AdamW on the adapters) "
              "are the same. The collectives are not: zerompi's go through MPI, which on one node is MPICH's "
              "shared memory; DeepSpeed's through torch.distributed's gloo backend over TCP loopback (no other "
              "backend is available to it on CPU here). The schedules differ too: zerompi gathers each unit's "
              "frozen shards in forward and again in backward and reduce-scatters only the adapters' gradients; "
              "DeepSpeed's defaults keep gathered parameters from forward to backward (reuse distance and live "
              "parameters 1e9), so it may gather once per step. 'sent' counts each rank's bytes in zerompi's "
              "ring-equivalent convention (zerompi: engine.stats.bytes_sent; DeepSpeed: its torch.distributed "
              "calls, peers/commcount.py)."]
    failed = [r for r in results if r["status"] != "ok"]
    lines += [f"\nFailed: {r['label']} repeat {r['repeat'] + 1}: {r['status']}\n\n```\n{r.get('error', '')}\n```"
              for r in failed]
    if reading:
        lines += ["", "## Reading", "", reading.strip()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    jsonl, md = args.out.with_suffix(".jsonl"), args.out.with_suffix(".md")
    reading = markdown.reading(args.reading)
    if args.report_only:
        markdown.write(md, markdown_report(*rows.split(rows.read(jsonl)), reading))
        return
    mpiexec = launch.find_mpiexec(None)
    command = " ".join(["python benchmarks/bench_lora_steps.py", *(argv if argv is not None else sys.argv[1:])])
    with rows.RowLog(jsonl, dict(meta_of(args, mpiexec, command), out=paths.shown(args.out))) as log:
        results = repeats.run(args.row_list, args.repeats, lambda row, _: run_row(row, args, mpiexec), log,
                              show=lambda r: f"{r['label']:30s} {r['status']:7s} {repeats.shown_step(r)} "
                                             f"({r['wall_s']:.0f} s)")
    markdown.write(md, markdown_report(log.meta, results, reading))


if __name__ == "__main__":
    main()
