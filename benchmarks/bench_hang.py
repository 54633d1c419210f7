"""A hang names its culprit: the injected faults of tests/mpi/test_hang.py, timed, and the recorder's cost.

    .venv/bin/python benchmarks/bench_hang.py faults [--ranks 2 3 4] [--ranks 16] [--only FAULT ...]
    .venv/bin/python benchmarks/bench_hang.py cost [--ranks 2 4]
    .venv/bin/python benchmarks/bench_hang.py report        # results/hang.md from results/hang.jsonl

* faults: each fault of tests/mpi/workers/hang.py (the last rank misbehaves at step 3, stage 3,
  hang_floor=2 s) as one mpiexec job per world size; whether rank 0's report names the culprit rank,
  what it is doing (its collective, user code, exception, or missing) and a frame of its stack; the
  exit code; the seconds from the fault to the report (report.txt's time) and to the job's end.
  Without --ranks the world sizes of the test cases; ``--ranks 16`` runs every fault at 16 ranks
  (on a machine with the cores for it: each rank is a Python process with torch).
* cost: benchmarks/workers/recorder_worker.py at each world size: a stage-3 GPT step with the ring
  on and off, alternating, and the time of one recorded event.

Rows go to results/hang.jsonl with the commit and the load average; ``report`` writes results/hang.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.mpi.launcher import mpi_env, mpiexec  # noqa: E402
from tests.mpi.test_hang import CASES, Job  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
JSONL, MD = RESULTS / "hang.jsonl", RESULTS / "hang.md"


def _stamp() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return {"commit": commit.strip(), "load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}


def _append(row: dict) -> None:
    with open(JSONL, "a") as f:
        f.write(json.dumps({**row, **_stamp()}) + "\n")
    print(json.dumps(row), flush=True)


def run_fault(fault: str, n: int, where: str, frame: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="zerompi-hang-bench-") as d:
        directory = Path(d)
        job = Job(n, fault, directory)
        report = directory / "report.txt"
        culprit = n - 1
        named = f"\nculprit: rank(s) {culprit} (" in job.err
        section = job.section(culprit) if named else ""
        median = None
        record = directory / "rank-00000.json"
        if record.exists():
            median = json.loads(record.read_text()).get("median_step")
        return {"kind": "fault", "fault": fault, "ranks": n, "exit": job.rc, "culprit": named,
                "where": where in section, "stack": None if frame is None else frame in section,
                "to_report_s": round(report.stat().st_mtime - job.fault, 2) if report.exists() and job.fault else None,
                "to_end_s": round(job.ended - job.fault, 2) if job.fault else None,
                "median_step_ms": None if median is None else round(median * 1e3, 1)}


# The fault the tests do not judge by the report: MPICH's mpiexec ends the job when a rank is killed
# (and names it: "KILLED BY SIGNAL: 9").
UNJUDGED = [("sigkill", 2, "missing", None)]


def faults(args) -> None:
    for fault, n, where, frame in CASES + UNJUDGED:
        if args.only and fault not in args.only:
            continue
        for size in (args.ranks or [n]):
            _append(run_fault(fault, size, where, frame))


def cost(args) -> None:
    for n in args.ranks or [2, 4]:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "row.json"
            cmd = [*mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py",
                   str(ROOT / "benchmarks" / "workers" / "recorder_worker.py"), "--out", str(out),
                   "--steps", str(args.steps), "--rounds", str(args.rounds)]
            subprocess.run(cmd, cwd=ROOT, env=mpi_env(), check=True, timeout=1800)
            _append({"kind": "cost", **json.loads(out.read_text())})


def _yes(v) -> str:
    return "-" if v is None else "yes" if v else "**no**"


def report(_args) -> None:
    rows = [json.loads(line) for line in JSONL.read_text().splitlines() if line.strip()]
    latest: dict[tuple, dict] = {}
    for r in rows:  # the latest run of each case
        latest[(r["kind"], r.get("fault"), r["ranks"])] = r
    stamps = sorted({(r["date"], r["commit"]) for r in latest.values()})
    out = ["# A hang names its culprit", "",
           f"Produced by `python benchmarks/bench_hang.py` on {', '.join(f'{d} ({c})' for d, c in stamps)}; "
           "a shared 2-core machine (load average per row in hang.jsonl), MPICH 5.0.2 (`mpiexec`), torch CPU.",
           "", "## Injected faults", "",
           "The last rank misbehaves at step 3 of a stage-3 job (tests/mpi/workers/hang.py), hang_floor=2 s "
           "(default 60 s). *culprit*: the report's culprit line is that rank alone; *where*: its line says "
           "what it does (the collective it waits in, user code, its exception, or missing); *stack*: a frame "
           "of the user's code that is at fault is shown. Times from the fault: to rank 0's report, and to "
           "the end of the job.", "",
           "| fault | ranks | culprit | where | stack | exit code | to report (s) | to end (s) | median step (ms) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (kind, fault, n), r in sorted(latest.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2])):
        if kind == "fault":
            out.append(f"| {fault} | {n} | {_yes(r['culprit'])} | {_yes(r['where'])} | {_yes(r['stack'])} | "
                       f"{r['exit']} | {r['to_report_s'] if r['to_report_s'] is not None else '-'} | "
                       f"{r['to_end_s'] if r['to_end_s'] is not None else '-'} | {r['median_step_ms'] or '-'} |")
    out += ["", "sigkill: MPICH's mpiexec ends the whole job when a rank dies (exit 9, `KILLED BY SIGNAL: 9`), "
            "so there is no hang to report; sigstop stands in for a dead rank under a launcher that leaves the "
            "others waiting (the report names it missing). save_alone: metadata exchanges run on a communicator "
            "of their own, so the lone save waits in its first one and is named (before, its all-gather met the "
            "others' parameter all-gather and MPICH aborted the job with `Message truncated`). A skipped module "
            "whose all-gather has another size than the next one's is still MPI's to report (`Message "
            "truncated`, naming the rank that noticed); hang.py's modules have equal sizes."]
    costs = [r for (k, _, _), r in sorted(latest.items()) if k == "cost"]
    if costs:
        out += ["", "## Cost of the recorder", "",
                "benchmarks/workers/recorder_worker.py: a GPT of 4 layers, 128 wide, at stage 3 (bucket_mb=0.25), "
                "steps with the ring on and off in alternating rounds. *estimated*: events per step x the time of "
                "one recorded event / the step time; *measured*: the difference of the median step times, which "
                "on this shared machine is noise of a few percent either way.", "",
                "| ranks | steps | events per step | ns per event | step on (ms) | step off (ms) | estimated "
                "| measured |",
                "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['ranks']} | {r['steps']} | {r['events_per_step']:g} | {r['begin_ns']} | {r['step_ms_on']} | "
                f"{r['step_ms_off']} | {r['estimated_pct']} % | {r['measured_pct']} % |" for r in costs]
    MD.write_text("\n".join(out) + "\n")
    print(MD.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("faults")
    f.add_argument("--ranks", type=int, nargs="+")
    f.add_argument("--only", nargs="+")
    c = sub.add_parser("cost")
    c.add_argument("--ranks", type=int, nargs="+")
    c.add_argument("--steps", type=int, default=10)
    c.add_argument("--rounds", type=int, default=6)
    sub.add_parser("report")
    args = p.parse_args()
    {"faults": faults, "cost": cost, "report": report}[args.command](args)
    if args.command != "report":
        report(args)


if __name__ == "__main__":
    main()
