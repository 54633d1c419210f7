"""Convergence of the main job with quantized collectives (ZeRO++ qwZ / qgZ) beside the unquantized run.

    .venv/bin/python benchmarks/bench_quantized.py run      # again and again, until it says "complete"
    .venv/bin/python benchmarks/bench_quantized.py report   # results/quantized.md and quantized-npN.png

The runs are jobs/train_gpt.py with jobs/configs/default.toml (stage 3, fp32, AdamW, warm-up and
cosine decay) for 600 steps, its schedule stretched to them (total_steps = steps), at 2 and 4
ranks, one run per variant and seed (``[train] seed``: model initialisation and data order;
``--seeds``, three by default): unquantized, int8 weights + int8 gradients, int8 weights + int4
gradients, and the latter with error feedback. The machine is shared, so one ``run`` invocation
takes about ``--budget-s`` seconds: it advances the run that is furthest behind by one segment
(``--segment`` steps; the job checkpoints and the next segment resumes, bitwise as if
uninterrupted, error-feedback residuals included), and so on in turn, interleaving the runs;
with ``--in-turn`` it finishes each run before starting the next, in the order world size,
seed, variant (so that what is done when time runs out is whole runs, paired across variants).
Every segment is recorded in results/quantized.jsonl with its wall time, the load average
before and after it (``uptime``'s) and the commit; rows without a ``seed`` are an earlier
single-seed series (seed 1337, commit cdabb0d) whose run directories are gone.

``report`` gives, per world size and variant, each seed's final validation loss, their mean and
spread (min to max, and the sample standard deviation), and the quantized mean's gap to the
unquantized mean. The verdict: "within seed noise" when that gap is no larger than the min-to-max
spread of the unquantized seeds and of the variant's seeds; otherwise "within X %" or "OUTSIDE
X %" against the allowed gap (int8 gradients: 1 %, int4: 2 %); no verdict until every listed
seed of both has finished. It draws the loss curves with ``zerompi plot``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import launch, markdown, rows, stamp  # noqa: E402
from harness.paths import RESULTS, ROOT  # noqa: E402
from zerompi.tools import plot  # noqa: E402

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
    dirty = stamp.dirty(("zerompi", "jobs", "benchmarks/bench_quantized.py"))
    return stamp.commit(short=True) + ("+dirty" if dirty else "")


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def write_config(path: Path, steps: int, zero: dict, seed: int) -> None:
    """The default config with ``steps`` steps (the schedule ending with them), ``seed`` and ``zero`` on top."""
    import tomllib
    doc = tomllib.loads(BASE.read_text())
    doc["train"].update(steps=steps, seed=seed)
    doc["zero"].update(total_steps=steps, **zero)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"[{table}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in body.items()) + "\n"
                            for table, body in doc.items()))


def run_dir(ranks: int, variant: str, seed: int) -> Path:
    return RUNS / f"np{ranks}-{variant}-s{seed}"


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


def segment(ranks: int, variant: str, seed: int, until: int, steps: int) -> dict:
    """Run one segment of one run (resuming from its checkpoint) up to step ``until``."""
    directory = run_dir(ranks, variant, seed)
    config = directory / "config.toml"
    write_config(config, steps, VARIANTS[variant][0], seed)
    start = done_steps(directory)
    cmd = launch.mpi_command(ranks, "jobs/train_gpt.py", "--config", config, "--steps", until, "--out", directory,
                             "--save-every", until, "--resume")
    job = launch.run(cmd, launch.job_env(mpich_yield=True), timeout=None)  # the budget bounds the segments
    if not job.ok:
        raise SystemExit(f"{' '.join(cmd)} failed: {job.error(lines=60)}")
    prune(directory)
    return dict(ranks=ranks, variant=variant, seed=seed, start=start, until=until, wall_s=round(job.wall_s, 1),
                load_before=job.loadavg_before, load_after=job.loadavg_after, commit=commit(),
                time=time.strftime("%Y-%m-%dT%H:%M:%S"))


def cmd_run(args) -> int:
    ranks = [int(x) for x in args.ranks.split(",")]
    order = [(n, s, v) for n in ranks for s in args.seeds for v in args.variants]
    history = rows.read(LOG) if LOG.exists() else []
    began, before = time.perf_counter(), len(history)
    while True:
        pending = [(done_steps(run_dir(n, v, s)), i, n, s, v) for i, (n, s, v) in enumerate(order)
                   if done_steps(run_dir(n, v, s)) < args.steps]
        if not pending:
            print("complete: every run reached", args.steps, "steps")
            return 0
        # The first unfinished run in the order listed, or the one furthest behind: interleaved.
        done, _, n, s, v = pending[0] if args.in_turn else min(pending)
        seg = args.segment * 2 // n  # 4 ranks take about twice as long per step on 2 cores
        past = [r["wall_s"] / (r["until"] - r["start"]) for r in history if (r["ranks"], r["variant"]) == (n, v)]
        guess = seg * (past[-1] if past else 2.0) + 20
        ran = len(history) > before  # at least one segment per invocation, whatever the guess
        if ran and time.perf_counter() - began + guess > args.budget_s:
            print(f"budget spent; next: np{n} {v} seed {s} from step {done} (about {guess:.0f} s)")
            return 0
        record = segment(n, v, s, min(args.steps, done + seg), args.steps)
        with rows.RowLog(LOG, mode=rows.Mode.APPEND) as log:
            history.append(log.add(record))
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


def seed_result(directory: Path, steps: int) -> float | str:
    """A finished run's final validation loss, or what stands in for it: "in progress (k/steps)" or "not run"."""
    done = done_steps(directory)
    if done >= steps and (directory / "metrics.jsonl").exists() and (last := final_val(directory)) and last[0] == steps:
        return last[1]
    return f"in progress ({done}/{steps})" if done or (directory / "metrics.jsonl").exists() else "not run"


def spread(values: list[float]) -> dict:
    """Mean, min, max and sample standard deviation (None for one value) of the seeds' final losses."""
    mean = sum(values) / len(values)
    std = (sum((x - mean) ** 2 for x in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else None
    return dict(mean=mean, min=min(values), max=max(values), std=std)


def verdict(base: dict, quant: dict, allowed: float) -> str:
    """"within seed noise" when the gap of the means is no larger than either side's min-to-max spread,
    else whether the relative gap is within the allowed one."""
    gap = abs(quant["mean"] - base["mean"])
    if gap <= min(base["max"] - base["min"], quant["max"] - quant["min"]):
        wide = max(base["max"] - base["min"], quant["max"] - quant["min"]) / base["mean"] > allowed
        return "within seed noise" + ("; the seed spread exceeds the allowed gap" if wide else "")
    return f"{'within' if gap / base['mean'] <= allowed else 'OUTSIDE'} {allowed:.0%}"


def _intro(args) -> list[str]:
    return ["# Convergence with quantized collectives", "",
            "Written by `benchmarks/bench_quantized.py report` from the runs of `bench_quantized.py run` "
            "(its docstring says what they are). Final validation loss of jobs/train_gpt.py (default config, "
            f"{args.steps} steps, cosine schedule over them) per variant and seed (`[train] seed`: model "
            "initialisation and data order), their mean and spread, and the gap of each variant's mean to "
            "the unquantized mean at the same world size, over the seeds finished for both.", "",
            "Verdict: **within seed noise** when the gap of the means is no larger than the min-to-max "
            "spread of the unquantized seeds and of the variant's seeds; otherwise **within X %** or "
            "**OUTSIDE X %** against the allowed relative gap (int8 gradients 1 %, int4 2 %). No verdict "
            f"until all {len(args.seeds)} seeds of both have finished; a run in progress or not run is "
            "shown as such and counts in no mean. Bytes are those one rank sent per step in parameter "
            "all-gathers and gradient reduce-scatters (the last logged interval of a finished run; the same "
            "for every seed).", ""]


def _paired_gap(results: dict, v: str, seeds: list[int]) -> tuple[float | None, list[int]]:
    """The relative gap of the means over the seeds finished on both sides only: one high seed on one side
    alone would otherwise move it by the whole seed spread."""
    both = [s for s in seeds if isinstance(results[v][s], float) and isinstance(results.get("none", {}).get(s), float)]
    if not both:
        return None, both
    mean_v, mean_0 = (sum(results[x][s] for s in both) / len(both) for x in (v, "none"))
    return (mean_v - mean_0) / mean_0, both


def _verdict_word(v: str, allowed: float | None, finals: dict, stats: dict, seeds: list[int]) -> str:
    if allowed is None:
        return "-"
    if len(finals[v]) == len(seeds) and len(finals.get("none", [])) == len(seeds):
        return verdict(stats.get("none"), stats.get(v), allowed)
    return f"no verdict: {len(finals[v])} of {len(seeds)} seeds finished" + (
        f" (none: {len(finals.get('none', []))})" if v != "none" else "")


def _variant_line(v: str, allowed: float | None, results: dict, finals: dict, stats: dict, sent: dict,
                  base_bytes: int, seeds: list[int]) -> tuple[str, dict]:
    """One variant's line of a world size's table, and its entry in quantized.json."""
    cells = [f"{x:.4f}" if isinstance(x, float) else x for x in results[v].values()]
    st = stats.get(v)
    gap, both = _paired_gap(results, v, seeds)
    paired = f" (seeds {', '.join(map(str, both))})" if both and len(both) < len(seeds) else ""
    word = _verdict_word(v, allowed, finals, stats, seeds)
    count = f" ({len(finals[v])} seeds)" if st and len(finals[v]) < len(seeds) else ""
    line = (f"| {v} | " + " | ".join(cells) + " | " +
            (f"{st['mean']:.4f}{count} | {st['min']:.4f} to {st['max']:.4f} ({st['max'] - st['min']:.4f}) | "
             f"{'-' if st['std'] is None else format(st['std'], '.4f')} | " if st else " |  |  | ") +
            ("" if gap is None or allowed is None else f"{gap:+.2%}{paired}") +
            f" | {'-' if allowed is None else f'{allowed:.0%}'} | {word} | " +
            ", ".join(f"{k} {b:,}" for k, b in sorted(sent.items())) + " | " +
            (f"{sum(sent.values()) / base_bytes:.3f}" if sent and base_bytes else "") + " |")
    entry = dict(final_val_loss={str(s): x for s, x in results[v].items()}, **(st or {}), rel_gap=gap,
                 allowed=allowed, verdict=word, bytes_per_step=sent)
    return line, entry


def _curves(n: int, args) -> list[str]:
    png = RESULTS / f"quantized-np{n}.png"
    series = [plot.read_metrics(str(run_dir(n, v, s))) for v in args.variants for s in args.seeds
              if (run_dir(n, v, s) / "metrics.jsonl").exists()]
    if not series:
        png.unlink(missing_ok=True)
        return [""]
    plot.draw(series, png, only=("loss",))
    return ["", f"![loss curves at {n} ranks]({png.name})", ""]


def _ranks_section(n: int, args, summary: dict) -> list[str]:
    results = {v: {s: seed_result(run_dir(n, v, s), args.steps) for s in args.seeds} for v in args.variants}
    finals = {v: [x for x in r.values() if isinstance(x, float)] for v, r in results.items()}
    stats = {v: spread(f) for v, f in finals.items() if f}
    traffic = {v: next((last_traffic(run_dir(n, v, s)) for s in args.seeds
                        if isinstance(results[v][s], float)), {}) for v in args.variants}
    base_bytes = sum(traffic.get("none", {}).values())
    lines = [f"## {n} ranks", "",
             "| variant | " + " | ".join(f"seed {s}" for s in args.seeds) +
             " | mean | min to max | std | mean vs none | allowed | verdict | bytes sent per step | of none's |",
             "|---|" + "---|" * len(args.seeds) + "---|---|---|---|---|---|---|---|"]
    for v, (_, allowed) in VARIANTS.items():
        if v not in args.variants:
            lines.append(f"| {v} | " + " | ".join("not run" for _ in args.seeds) + " |  |  |  |  |  |  |  |  |")
            continue
        line, summary[f"np{n}-{v}"] = _variant_line(v, allowed, results, finals, stats, traffic[v], base_bytes,
                                                    args.seeds)
        lines.append(line)
    return lines + _curves(n, args)


def _conditions(history: list[dict]) -> list[str]:
    lines = ["## Conditions", ""]
    if history:
        commits = sorted({r["commit"] for r in history})
        loads = [r["load_before"][0] for r in history] + [r["load_after"][0] for r in history]
        walls = {}
        for r in history:
            walls.setdefault(f"np{r['ranks']}-{r['variant']}-s{r['seed']}", []).append(
                r["wall_s"] / (r["until"] - r["start"]))
        lines += [f"- commits: {', '.join(commits)}; {len(history)} segments from {history[0]['time']} to "
                  f"{history[-1]['time']}",
                  f"- 1-minute load average around the segments (`uptime`): {min(loads):.2f} to {max(loads):.2f} "
                  "on 2 cores shared with other jobs: wall times are not comparisons of speed",
                  "- wall seconds per step (start-up included), median per run: " +
                  ", ".join(f"{k} {sorted(w)[len(w) // 2]:.2f}" for k, w in sorted(walls.items()))]
    return lines + ["- rows of results/quantized.jsonl without a seed are an earlier single-seed series (seed "
                    "1337, commit cdabb0d) whose run directories are gone; they count in nothing above", ""]


def cmd_report(args) -> int:
    ranks = [int(x) for x in args.ranks.split(",")]
    runs = {(n, v, s) for n in ranks for v in args.variants for s in args.seeds}
    history = [r for r in rows.read(LOG) if "seed" in r]  # rows without one: the earlier single-seed series
    lines, summary = _intro(args), {}
    for n in ranks:
        lines += _ranks_section(n, args, summary)
    lines += _conditions([r for r in history if (r["ranks"], r["variant"], r["seed"]) in runs])
    markdown.write(RESULTS / "quantized.md", "\n".join(lines))
    (RESULTS / "quantized.json").write_text(json.dumps(summary, indent=1) + "\n")
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
    p.add_argument("--seeds", default="1337,1,2", help="comma list of [train] seed values, one run each")
    p.add_argument("--in-turn", action="store_true",
                   help="finish each run before starting the next (world size, then seed, then variant)")
    args = p.parse_args()
    args.variants = args.variants.split(",")
    args.seeds = [int(x) for x in args.seeds.split(",")]
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    return cmd_run(args) if args.mode == "run" else cmd_report(args)


if __name__ == "__main__":
    raise SystemExit(main())
