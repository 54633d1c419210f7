"""What reproducible=True costs: step time, bytes sent and peak memory per rank against the default mode.

    python benchmarks/bench_reproducible.py [--ranks 2 4] [--micro-batches 4] [--steps 12] [--rounds 3]

Runs the GPT job (jobs/train_gpt.py, jobs/configs/default.toml: 3.3M parameters, stage 3, fp32)
with the same global batch both ways: the default mode with grad_accum_steps = G / N, and
``--reproducible --micro-batches G``. Each (ranks, mode) job is its own ``mpiexec``; modes take turns
within a round and rounds repeat, so drift on the machine falls on both sides. Per job: the median
training time per step over the records after the first (metrics.jsonl: tokens/s, evaluation
excluded), bytes sent per step by kind, and the peak RSS of the largest rank (the job's
RUSAGE_CHILDREN). Results: --out.{md,jsonl}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)]
from zerompi.tools.mpirun import mpi_env, mpiexec  # noqa: E402

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
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "jobs/train_gpt.py", "--config", str(cfg),
           "--out", str(out), *flags]
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEASURE, *cmd], cwd=ROOT, env=mpi_env(ROOT), capture_output=True,
                          text=True, timeout=1800)
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    if measured["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {measured['rc']}:\n{proc.stderr[-6000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = g * tomllib.loads(cfg.read_text())["train"]["micro_batch"] * \
        tomllib.loads(cfg.read_text())["model"]["block_size"]
    step_s = [tokens_per_step / r["tokens_per_s"] for r in records[1:]]  # the first step warms up
    return dict(ranks=ranks, mode=mode, micro_batches=g, step_s=statistics.median(step_s),
                bytes_per_step=records[-1]["bytes_sent_per_step"], loss=records[-1]["loss"],
                peak_rss_mib=measured["maxrss_kib"] / 1024, model_state_bytes=records[-1]["model_state_bytes"],
                job_s=time.perf_counter() - t0, load=[load0, os.getloadavg()[0]])


def report(rows: list[dict], args, commit: str) -> str:
    lines = [f"# reproducible=True against the default mode (issue #29)", "",
             f"`benchmarks/bench_reproducible.py --ranks {' '.join(map(str, args.ranks))} --micro-batches "
             f"{args.micro_batches} --steps {args.steps} --rounds {args.rounds}` at {commit}, "
             f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores. "
             "The GPT job (default.toml: 3.3M parameters, stage 3, fp32, AdamW, clipping), the same global batch "
             f"of G = {args.micro_batches} micro-batches of 8 x 128 tokens both ways; modes take turns in each round.",
             "", "| ranks | mode | step time, s (median of rounds; rounds) | bytes sent per step | peak RSS of the "
             "largest rank, MiB (median) |", "|---|---|---|---|---|"]
    ratios = []
    for ranks in args.ranks:
        by_mode = {m: [r for r in rows if r["ranks"] == ranks and r["mode"] == m] for m in MODES}
        for mode, rs in by_mode.items():
            times = [r["step_s"] for r in rs]
            sent = sum(rs[-1]["bytes_per_step"].values())
            lines.append(f"| {ranks} | {mode} | {statistics.median(times):.3f} ({', '.join(f'{t:.3f}' for t in times)}) "
                         f"| {sent:,} | {statistics.median(r['peak_rss_mib'] for r in rs):.0f} |")
        t = {m: statistics.median(r["step_s"] for r in rs) for m, rs in by_mode.items()}
        b = {m: sum(rs[-1]["bytes_per_step"].values()) for m, rs in by_mode.items()}
        spread = max(r["step_s"] for r in by_mode["default"]) / min(r["step_s"] for r in by_mode["default"])
        m = {mode: statistics.median(r["peak_rss_mib"] for r in rs) for mode, rs in by_mode.items()}
        ratios.append(f"- {ranks} ranks: step time {t['reproducible'] / t['default']:.3f}x the default (the "
                      f"default rounds' own max/min is {spread:.3f}), bytes sent {b['reproducible'] / b['default']:.3f}x, "
                      f"peak RSS {m['reproducible'] - m['default']:+.0f} MiB per rank.")
    return "\n".join(lines + ["", "Ratios (reproducible / default, medians):", *ratios, ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "reproducible"))
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfgs = {n: config(ROOT / "jobs/configs/default.toml", n, args.micro_batches, args.steps, tmp) for n in args.ranks}
        for k in range(args.rounds):
            for ranks in args.ranks:
                for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                    row = dict(run(ranks, mode, cfgs[ranks], args.micro_batches, tmp / f"{ranks}-{mode}-{k}"),
                               round=k, commit=commit)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    Path(args.out + ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path(args.out + ".md").write_text(report(rows, args, commit))
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
