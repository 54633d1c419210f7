"""What reproducible=True costs: step time, bytes sent and peak memory per rank against the default mode.

    python benchmarks/bench_reproducible.py [--ranks 2 4] [--micro-batches 4] [--steps 12] [--rounds 2]
    python benchmarks/bench_reproducible.py --bytes [--ranks 2 4] [--bytes-g 4 8]   # bytes alone, stages 0-3

The GPT of jobs/configs/default.toml (3.3M parameters, stage 3, fp32, AdamW, clipping) with the same
global batch both ways: the default mode with grad_accum_steps = G / N, and reproducible=True with
micro_batches = G. Time and bytes: workers/reproducible_ab.py runs both modes in one job, each its own
engine, taking turns step by step (so drift on the machine falls on both alike); --rounds such jobs per
world size. Memory: the GPT job (jobs/train_gpt.py) once per mode, its own ``mpiexec``, the peak RSS of
the largest rank (RUSAGE_CHILDREN). Results: --out.{md,jsonl}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, repeats, rows, stamp  # noqa: E402
from harness.paths import ROOT, WORKERS  # noqa: E402

MODES = ("default", "reproducible")
MEASURE = """
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:])
print(json.dumps(dict(rc=proc.returncode, maxrss_kib=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)))
"""


def toml_line(key: str, value) -> str:
    return f"{key} = {json.dumps(value)}"


def config(base: Path, ranks: int, g: int, steps: int, tmp: Path) -> Path:
    """default.toml with grad_accum_steps = G / ranks (the default mode's same global batch), no evaluation
    and no checkpoints; the reproducible runs take the same file (their flags set grad_accum_steps=1)."""
    doc = tomllib.loads(base.read_text())
    doc["zero"]["grad_accum_steps"] = g // ranks
    doc["zero"]["cpu_threads"] = 1
    doc["train"].update(steps=steps, log_every=1, eval_every=0, save_every=0)
    text = "\n".join(f"[{table}]\n" + "\n".join(toml_line(k, v) for k, v in doc[table].items()) + "\n"
                     for table in ("model", "train", "zero"))
    path = tmp / f"np{ranks}.toml"
    path.write_text(text)
    return path


def run(ranks: int, mode: str, cfg: Path, g: int, out: Path) -> dict:
    flags = ["--reproducible", "--micro-batches", str(g)] if mode == "reproducible" else []
    cmd = launch.mpi_command(ranks, "jobs/train_gpt.py", "--config", cfg, "--out", out, *flags)
    job = launch.run([sys.executable, "-c", MEASURE, *cmd], launch.job_env(mpich_yield=True)).check()
    measured = next(json.loads(ln) for ln in reversed(job.output.splitlines()) if ln.startswith('{"rc"'))
    if measured["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {measured['rc']}:\n{job.output[-6000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = g * tomllib.loads(cfg.read_text())["train"]["micro_batch"] * \
        tomllib.loads(cfg.read_text())["model"]["block_size"]
    step_s = [tokens_per_step / r["tokens_per_s"] for r in records[1:]]  # the first step warms up
    return dict(ranks=ranks, mode=mode, micro_batches=g, step_s=statistics.median(step_s),
                bytes_per_step=records[-1]["bytes_sent_per_step"], loss=records[-1]["loss"],
                peak_rss_mib=measured["maxrss_kib"] / 1024, model_state_bytes=records[-1]["model_state_bytes"],
                job_s=job.wall_s, load=[job.loadavg_before[0], job.loadavg_after[0]])


def ab(ranks: int, args, out: Path, *extra: str) -> dict:
    cmd = launch.mpi_command(ranks, WORKERS / "reproducible_ab.py", "--out", out, "--steps", args.steps,
                             "--g", args.micro_batches, *extra)
    job, result = launch.run_json(cmd, out, launch.job_env(mpich_yield=True))
    job.check()
    return dict(result, load=[job.loadavg_before[0], job.loadavg_after[0]])


def report(ab_rows: list[dict], mem: list[dict], args, commit: str) -> str:
    lines = ["# reproducible=True against the default mode (issue #29)", "",
             f"`benchmarks/bench_reproducible.py --ranks {' '.join(map(str, args.ranks))} --micro-batches "
             f"{args.micro_batches} --steps {args.steps} --rounds {args.rounds}` at {commit}, "
             f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, "
             f"load average {min(r['load'][0] for r in ab_rows):.1f}-{max(r['load'][1] for r in ab_rows):.1f}. "
             "The GPT of default.toml (3.3M parameters, stage 3, fp32, AdamW, clipping), the same global batch of "
             f"G = {args.micro_batches} micro-batches of 8 x 128 tokens both ways. Step times: both modes in one job, "
             "alternating steps, the slowest rank's time per step; bytes: summed over the ranks.", "",
             "| ranks | default s/step (median; per round) | reproducible s/step (median; per round) | ratio | "
             "default max/min step | bytes sent per step, reproducible / default | peak RSS of the largest rank, "
             "MiB: default, reproducible |", "|---|---|---|---|---|---|---|"]
    for ranks in args.ranks:
        rs = [r for r in ab_rows if r["ranks"] == ranks]
        med = {m: statistics.median(t for r in rs for t in r["times"][m]) for m in MODES}
        per = {m: ", ".join(f"{statistics.median(r['times'][m]):.3f}" for r in rs) for m in MODES}
        spread = max(t for r in rs for t in r["times"]["default"]) / min(t for r in rs for t in r["times"]["default"])
        sent = {m: statistics.median(b for r in rs for b in r["bytes_sent"][m]) for m in MODES}
        rss = {m: next(x["peak_rss_mib"] for x in mem if x["ranks"] == ranks and x["mode"] == m) for m in MODES}
        lines.append(f"| {ranks} | {med['default']:.3f} ({per['default']}) | {med['reproducible']:.3f} "
                     f"({per['reproducible']}) | {med['reproducible'] / med['default']:.3f} | {spread:.2f} | "
                     f"{sent['reproducible'] / sent['default']:.4f} ({sent['reproducible'] / ranks:,.0f} vs "
                     f"{sent['default'] / ranks:,.0f} per rank) | {rss['default']:.0f}, {rss['reproducible']:.0f} |")
    return "\n".join(lines + ["", "Ratio: the median step of reproducible=True over the median step of the default "
                              "mode (inside the default's own step spread: at parity).", ""])


def bytes_report(found: list[dict], args, commit: str) -> str:
    lines = ["# reproducible=True: bytes sent per step at every stage", "",
             f"`benchmarks/bench_reproducible.py --bytes --ranks {' '.join(map(str, args.ranks))} --micro-batches "
             f"{' '.join(map(str, args.bytes_g))}` at {commit}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
             "UTC. The GPT of default.toml (3.3M parameters, fp32, AdamW, clipping) at each stage, the same global "
             "batch of G micro-batches both ways (the default mode: grad_accum_steps = G / N). Bytes of one step "
             "after a warm-up step, summed over the ranks (they are the same every step).", "",
             "| stage | ranks | G | default bytes | reproducible bytes | ratio | stages 0-1: (G/N + 1) / 2 | "
             "reproducible's kinds (default's) |", "|---|---|---|---|---|---|---|---|"]
    for r in found:
        d, p = r["bytes_sent"]["default"][-1], r["bytes_sent"]["reproducible"][-1]
        kinds = ", ".join(f"{k} {v:,}" for k, v in r["kinds"]["reproducible"].items())
        theirs = ", ".join(f"{k} {v:,}" for k, v in r["kinds"]["default"].items())
        lines.append(f"| {r['stage']} | {r['ranks']} | {r['g']} | {d:,} | {p:,} | {p / d:.3f} | "
                     f"{(r['g'] / r['ranks'] + 1) / 2 if r['stage'] < 2 else '-'} | {kinds} ({theirs}) |")
    return "\n".join(lines + ["", EXTRA, ""])


EXTRA = """Where the extra comes from. Stages 2-3 reduce every micro-batch in both modes; reproducible=True's
all-to-all moves what the reduce-scatter moves, and adds two things: shards padded to whole
1024-element norm chunks (the larger reduce_scatter and all_gather counts) and the exact norm's chunk
sums (control: 8 bytes per 1024 elements per rank, against one float per rank). Stages 0-1 run stage 2's
gradient row in this mode: each of the G/N rounds sends a full gradient's (N-1)/N, where the default
mode reduces the window's local sum once; so their bytes are (G/N + 1) / 2 times the default's (the
parameters' all-gather is the +1), 1.0x at G = N and 2.5x at G/N = 4. That is a limit of the mode, not
of the code: an owner adds every micro-batch's gradient in global index order, so it must receive each
of them, and no rank can add its own micro-batches first (g0 + g2 before g1 is another sum)."""


def measure_bytes(args, commit: str) -> None:
    """--bytes: one A/B job per stage, world size and G; OUT-bytes.{jsonl,md}."""
    args.steps = 1
    with rows.RowLog(Path(args.out + "-bytes.jsonl")) as log, tempfile.TemporaryDirectory() as tmp:
        for stage in range(4):
            for ranks in args.ranks:
                for g in args.bytes_g:
                    args.micro_batches = g
                    row = log.add(dict(ab(ranks, args, Path(tmp) / "b.json", "--stage", str(stage), "--warmup", "1"),
                                       commit=commit, kind="bytes"))
                    print(json.dumps(row), flush=True)
    markdown.write(Path(args.out + "-bytes.md"), bytes_report(log.rows, args, commit))


def measure_cost(args, commit: str) -> None:
    """Step time and bytes (A/B jobs, --rounds interleaved over the world sizes), then peak memory per mode."""
    with rows.RowLog(Path(args.out + ".jsonl")) as log, tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for k, ranks in repeats.interleaved(args.ranks, args.rounds):
            row = log.add(dict(ab(ranks, args, tmp / f"ab-{ranks}-{k}.json"), round=k, commit=commit, kind="ab"))
            print(json.dumps(row), flush=True)
        for ranks in args.ranks:
            cfg = config(ROOT / "jobs/configs/default.toml", ranks, args.micro_batches, 6, tmp)
            for mode in MODES:
                row = log.add(dict(run(ranks, mode, cfg, args.micro_batches, tmp / f"{ranks}-{mode}"),
                                   commit=commit, kind="memory"))
                print(json.dumps(row), flush=True)
    ab_rows = [r for r in log.rows if r["kind"] == "ab"]
    markdown.write(Path(args.out + ".md"), report(ab_rows, [r for r in log.rows if r["kind"] == "memory"], args,
                                                  commit))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results" / "reproducible"))
    p.add_argument("--bytes", action="store_true", help="bytes alone, at every stage (results: OUT-bytes)")
    p.add_argument("--bytes-g", type=int, nargs="+", default=[4, 8], help="--bytes: the G values")
    args = p.parse_args()
    (measure_bytes if args.bytes else measure_cost)(args, stamp.commit(short=True))


if __name__ == "__main__":
    main()
