"""Convergence of the main job with quantized collectives (ZeRO++ qwZ / qgZ) beside the unquantized run.

    .venv/bin/python benchmarks/bench_quantized.py run      # again and again, until it says "complete"
    .venv/bin/python benchmarks/bench_quantized.py report   # results/quantized.md and quantized-npN.png

The runs are jobs/train_gpt.py with jobs/configs/default.toml (stage 3, fp32, AdamW, warm-up and
cosine decay) for 600 steps, its schedule stretched to them (total_steps = steps), at 2 and 4
ranks, one run per variant: unquantized, int8 weights + int8 gradients, int8 weights + int4
gradients, and the latter with error feedback. The machine is shared, so one ``run`` invocation
takes about ``--budget-s`` seconds: it advances the run that is furthest behind by one segment
(``--segment`` steps; the job checkpoints and the next segment resumes, bitwise as if
uninterrupted, error-feedback residuals included), and so on in turn, interleaving the variants.
Every segment is recorded in results/quantized.jsonl with its wall time, the load average
before and after it (``uptime``'s) and the commit. ``report`` compares each run's final
validation loss with the unquantized run at its world size (int8 gradients: within 1 %, int4:
within 2 %) and draws the curves with ``zerompi plot``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from zerompi.tools import plot  # noqa: E402
from zerompi.tools.mpirun import mpi_env, mpiexec  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LOG = RESULTS / "quantized.jsonl"
RUNS = ROOT / "out" / "quantized"
BASE = ROOT / "jobs" / "configs" / "default.toml"
VARIANTS = {
    "none": ({}, None),
    "w8g8": ({"quantize_weights": "int8", "quantize_grads": "int8"}, 0.01),
    "w8g4": ({"quantize_weights": "int8", "quantize_grads": "int4"}, 0.02),
    "w8g4-ef": ({"quantize_weights": "int8", "quantize_grads": "int4", "grad_error_feedback": True}, 0.02),
}
"""variant -> (ZeroConfig fields on top of the default config, allowed relative final val-loss gap)."""


def commit() -> str:
    """The commit of the code the runs use: git's, or, in a tree exported with ``git archive`` (so that
    editing the worktree cannot change runs in progress), the ``.commit`` file written beside it."""
    if (ROOT / ".commit").exists():
        return (ROOT / ".commit").read_text().strip()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "zerompi", "jobs", "benchmarks/bench_quantized.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return rev.stdout.strip() + ("+dirty" if dirty else "")


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def write_config(path: Path, steps: int, zero: dict) -> None:
    """The default config with ``steps`` steps (the schedule ending with them) and ``zero`` on top."""
    import tomllib
    doc = tomllib.loads(BASE.read_text())
    doc["train"]["steps"] = steps
    doc["zero"].update(total_steps=steps, **zero)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"[{table}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in body.items()) + "\n"
                            for table, body in doc.items()))


def run_dir(ranks: int, variant: str) -> Path:
    return RUNS / f"np{ranks}-{variant}"


def done_steps(directory: Path) -> int:
    latest = directory / "checkpoints" / "latest"
    return int(latest.read_text().strip().removeprefix("step")) if latest.exists() else 0


def prune(directory: Path) -> None:
    """Keep only the checkpoint ``latest`` names (each is ~60 MB per rank)."""
    ckpt = directory / "checkpoints"
    keep = (ckpt / "latest").read_text().strip()
    for tag in ckpt.iterdir():
        if tag.is_dir() and tag.name != keep:
            shutil.rmtree(tag, ignore_errors=True)


def segment(ranks: int, variant: str, until: int, steps: int) -> dict:
    """Run one segment of one run (resuming from its checkpoint) up to step ``until``."""
    directory = run_dir(ranks, variant)
    config = directory / "config.toml"
    write_config(config, steps, VARIANTS[variant][0])
    start, load0, t0 = done_steps(directory), os.getloadavg(), time.perf_counter()
    cmd = [*mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "jobs/train_gpt.py", "--config", str(config),
           "--steps", str(until), "--out", str(directory), "--save-every", str(until), "--resume"]
    env = {**mpi_env(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    prune(directory)
    return dict(ranks=ranks, variant=variant, start=start, until=until, wall_s=round(wall, 1),
                load_before=[round(x, 2) for x in load0], load_after=[round(x, 2) for x in os.getloadavg()],
                commit=commit(), time=time.strftime("%Y-%m-%dT%H:%M:%S"))


def cmd_run(args) -> int:
    ranks = [int(x) for x in args.ranks.split(",")]
    order = [(n, v) for n in ranks for v in args.variants]
    history = [json.loads(line) for line in LOG.read_text().splitlines()] if LOG.exists() else []
    began, before = time.perf_counter(), len(history)
    while True:
        pending = [(done_steps(run_dir(n, v)), i, n, v) for i, (n, v) in enumerate(order)
                   if done_steps(run_dir(n, v)) < args.steps]
        if not pending:
            print("complete: every run reached", args.steps, "steps")
            return 0
        done, _, n, v = min(pending)  # the run furthest behind, in the order listed: interleaved
        seg = args.segment * 2 // n  # 4 ranks take about twice as long per step on 2 cores
        past = [r["wall_s"] / (r["until"] - r["start"]) for r in history if (r["ranks"], r["variant"]) == (n, v)]
        guess = seg * (past[-1] if past else 2.0) + 20
        ran = len(history) > before  # at least one segment per invocation, whatever the guess
        if ran and time.perf_counter() - began + guess > args.budget_s:
            print(f"budget spent; next: np{n} {v} from step {done} (about {guess:.0f} s)")
            return 0
        record = segment(n, v, min(args.steps, done + seg), args.steps)
        history.append(record)
        with LOG.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


def final_val(directory: Path) -> tuple[int, float] | None:
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    return evals[-1] if evals else None


def last_traffic(directory: Path) -> dict[str, int]:
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    sent = [r["bytes_sent_per_step"] for r in rows if "bytes_sent_per_step" in r]
    keep = ("all_gather", "reduce_scatter")
    return {k: v for k, v in sent[-1].items() if k.split(".")[0].split("@")[0] in keep} if sent else {}


def cmd_report(args) -> int:
    ranks = [int(x) for x in args.ranks.split(",")]
    history = [json.loads(line) for line in LOG.read_text().splitlines()]
    lines = ["# Convergence with quantized collectives", "",
             "Written by `benchmarks/bench_quantized.py report` from the runs of `bench_quantized.py run` "
             "(its docstring says what they are). Final validation loss of jobs/train_gpt.py (default config, "
             f"{args.steps} steps, cosine schedule over them) per variant, against the unquantized run at the "
             "same world size; bytes are those one rank sent per step in parameter all-gathers and gradient "
             "reduce-scatters (the last logged interval).", ""]
    summary = {}
    for n in ranks:
        base = final_val(run_dir(n, "none"))
        lines += [f"## {n} ranks", "", "| variant | final val loss (step) | vs none | allowed | verdict | "
                  "bytes sent per step | of none's |", "|---|---|---|---|---|---|---|"]
        base_bytes = sum(last_traffic(run_dir(n, "none")).values())
        for v, (fields, allowed) in VARIANTS.items():
            d = run_dir(n, v)
            if v not in args.variants or not (d / "metrics.jsonl").exists():
                lines.append(f"| {v} | not run |  |  |  |  |  |")
                continue
            step, val = final_val(d)
            gap = (val - base[1]) / base[1]
            traffic = last_traffic(d)
            verdict = "-" if allowed is None else ("within" if abs(gap) <= allowed else "OUTSIDE")
            lines.append(f"| {v} | {val:.4f} ({step}) | {gap:+.2%} | {'-' if allowed is None else f'{allowed:.0%}'} "
                         f"| {verdict} | {', '.join(f'{k} {b:,}' for k, b in sorted(traffic.items()))} | "
                         f"{sum(traffic.values()) / base_bytes:.3f} |")
            summary[f"np{n}-{v}"] = dict(final_val_loss=val, step=step, rel_gap=gap, allowed=allowed,
                                         bytes_per_step=traffic)
        png = RESULTS / f"quantized-np{n}.png"
        plot.draw([plot.read_metrics(str(run_dir(n, v))) for v in VARIANTS
                   if v in args.variants and (run_dir(n, v) / "metrics.jsonl").exists()], png)
        lines += ["", f"![curves at {n} ranks]({png.name})", ""]
    commits = sorted({r["commit"] for r in history})
    loads = [r["load_before"][0] for r in history] + [r["load_after"][0] for r in history]
    walls = {}
    for r in history:
        walls.setdefault(f"np{r['ranks']}-{r['variant']}", []).append(r["wall_s"] / (r["until"] - r["start"]))
    lines += ["## Conditions", "",
              f"- commits: {', '.join(commits)}; {len(history)} segments from {history[0]['time']} to "
              f"{history[-1]['time']}",
              f"- 1-minute load average around the segments (`uptime`): {min(loads):.2f} to {max(loads):.2f} "
              "on 2 cores shared with other jobs: wall times are not comparisons of speed",
              "- wall seconds per step (start-up included), median per run: " +
              ", ".join(f"{k} {sorted(w)[len(w) // 2]:.2f}" for k, w in sorted(walls.items())), ""]
    (RESULTS / "quantized.md").write_text("\n".join(lines))
    (RESULTS / "quantized.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("run", "report"))
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--segment", type=int, default=100, help="steps per segment at 2 ranks (half that at 4)")
    p.add_argument("--budget-s", type=float, default=540, help="seconds one 'run' invocation may take")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma list of " + ", ".join(VARIANTS) + " (error feedback only where int4 needs it)")
    args = p.parse_args()
    args.variants = args.variants.split(",")
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    return cmd_run(args) if args.mode == "run" else cmd_report(args)


if __name__ == "__main__":
    raise SystemExit(main())
