"""What a process start costs the test suite: the CPU seconds of importing each stack the MPI tests' ranks
import, and of one worker job at 1 and 4 ranks on this machine's cores.

    python benchmarks/startup_cost.py [--repeats 3]

The suite runs about 600 processes (MPI ranks and single-process references), each paying these imports
once; on 2 cores CPU seconds are what a suite's wall time is made of. The job rows run
tests/mpi/workers/reproducible.py (the same micro-batches at any world size): the CPU its 4-rank job
takes beyond four 1-rank starts is what oversubscribing the cores adds. Rows: each measurement, interleaved
repeats (harness/repeats.py); results ``benchmarks/results/startup_cost.{jsonl,md}``.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, repeats  # noqa: E402
from harness.rows import RowLog  # noqa: E402

IMPORTS = {  # row: the modules a process imports
    "python": "",
    "torch": "torch",
    "torch + zerompi": "torch, zerompi",
    "torch + zerompi + deepspeed": "torch, zerompi, deepspeed",
    "torch + transformers": "torch, transformers",
    "torch + zerompi + peft": "torch, zerompi, peft",
    "torch + lightning": "torch, lightning",
}
JOBS = {"reproducible worker, 1 rank": 1, "reproducible worker, 4 ranks": 4}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(item: str, repeat: int, out: Path) -> dict:
    if item in IMPORTS:
        cmd = [sys.executable, "-c", f"import {IMPORTS[item]}" if IMPORTS[item] else "pass"]
    else:
        cmd = launch.mpi_command(JOBS[item], HERE.parent / "tests/mpi/workers/reproducible.py",
                                 "--out", str(out / f"{JOBS[item]}.json"))
    cpu = children_cpu()
    outcome = launch.run(cmd, launch.job_env(mpich_yield=True), timeout=900)  # reaped: its CPU is counted
    return {"row": item, "status": outcome.status.value, "wall_s": round(outcome.wall_s, 3),
            "cpu_s": round(children_cpu() - cpu, 3), **({} if outcome.ok else {"error": outcome.error()})}


def report(rows: list[dict], path: Path) -> None:
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok":
            by.setdefault(r["row"], []).append(r)
    body = []
    for name in [*IMPORTS, *JOBS]:
        got = by.get(name, [])
        if got:
            cpu = [r["cpu_s"] for r in got]
            wall = [r["wall_s"] for r in got]
            body.append([name, statistics.median(cpu), f"{min(cpu):.2f}-{max(cpu):.2f}", statistics.median(wall),
                         len(got)])
    stamp = rows[-1]["stamp"] if rows else {}
    lines = ["# Process start-up cost", "", f"`python benchmarks/startup_cost.py` at {stamp.get('commit', '?')[:7]}; "
             f"rows: `startup_cost.jsonl`; load average at the end {markdown.load(stamp.get('loadavg', ()))}.", "",
             *markdown.table(["row", "CPU s (median)", "CPU s (range)", "wall s (median)", "repeats"], body)]
    one, four = (by.get(k) for k in JOBS)
    if one and four:
        c1, c4 = (statistics.median(r["cpu_s"] for r in rs) for rs in (one, four))
        lines += ["", f"The 4-rank job takes {c4:.1f} CPU s against {c1:.1f} at 1 rank for the same micro-batches: "
                      f"{c4 - 4 * c1:+.1f} s beyond four 1-rank runs, what sharing 2 cores among 4 ranks adds."]
    markdown.write(path, "\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "results" / "startup_cost", help="results prefix")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as work, RowLog(a.out.with_suffix(".jsonl"), {"repeats": a.repeats}) as log:
        rows = repeats.run([*IMPORTS, *JOBS], a.repeats, lambda item, r: measure(item, r, Path(work)), log,
                           lambda row: f"{row['row']}: {row['cpu_s']} CPU s")
    report(rows, a.out.with_suffix(".md"))
    print(a.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
