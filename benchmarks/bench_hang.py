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
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, rows  # noqa: E402
from harness.paths import RESULTS, ROOT, WORKERS  # noqa: E402

OUT = RESULTS / "hang"  # hang.jsonl (every run's rows, appended) and hang.md
# The fault injector is the tests' worker: the benchmark times the very faults the tests judge. It is run
# as a script, never imported.
HANG_WORKER = ROOT / "tests" / "mpi" / "workers" / "hang.py"
JOB_TIMEOUT_S = 180.0

# fault, ranks, what the culprit's line says, a frame of its stack (None: no stack, a missing rank).
# A copy of tests/mpi/test_hang.py's CASES (the benchmark does not import the tests): when a case is
# added there, add it here too.
CASES = [
    ("extra_microbatch", 2, "waiting", "in train_step: engine.backward(engine(load_batch"),
    ("skip_module", 3, "waiting", "in train_step"),
    ("loader_sleep", 2, "not in a collective: in user code", "in load_batch: time.sleep(600)"),
    ("busy_loop", 4, "not in a collective: in user code", "in train_step: spin()"),
    ("sigstop", 2, "missing", None),
    ("raise", 3, "raised RuntimeError: boom in user code", "in train_step: raise RuntimeError"),
    ("user_barrier", 4, "not in a collective: in user code", "in train_step: USER.Barrier()"),
    ("branch", 3, "waiting", "in train_step"),
    ("step_early", 2, "raised UsageError: step() called before backward()", "in train_step: return engine.step()"),
    ("oom", 4, "raised RuntimeError", "in forward: torch.empty(2**62"),
    ("save_alone", 3, "waiting", "in train_step: engine.save_checkpoint("),
]


def _append(row: dict, out: Path) -> None:
    with rows.RowLog(out.with_suffix(".jsonl"), mode=rows.Mode.APPEND) as log:
        log.add(row)
    print(json.dumps(row), flush=True)


def culprit_section(report: str, rank: int) -> str:
    """The culprit block of rank 0's hang report for ``rank`` (its line and stack); '' if it is not named."""
    m = re.search(r"^culprit: .*?\n((?:  .*\n)*?)(?:first divergence|every rank)", report, re.M)
    if not m or f"  rank {rank}: " not in m.group(1):
        return ""
    block = m.group(1)
    start = block.index(f"  rank {rank}: ")
    nxt = re.search(r"^  rank \d+: ", block[start + 3:], re.M)
    return block[start:start + 3 + nxt.start()] if nxt else block[start:]


def run_fault(fault: str, n: int, where: str, frame: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="zerompi-hang-bench-") as d:
        directory = Path(d)
        cmd = launch.mpi_command(n, HANG_WORKER, "--fault", fault, "--dir", directory)
        job = launch.run(cmd, launch.job_env(mpich_yield=True), JOB_TIMEOUT_S)
        ended = time.time()
        fault_time = directory / "fault.time"
        at = float(fault_time.read_text()) if fault_time.exists() else None
        report = directory / "report.txt"
        culprit = n - 1
        named = f"\nculprit: rank(s) {culprit} (" in job.output
        section = culprit_section(job.output, culprit) if named else ""
        record = directory / "rank-00000.json"
        median = json.loads(record.read_text()).get("median_step") if record.exists() else None
        return {"kind": "fault", "fault": fault, "ranks": n, "exit": job.code, "culprit": named,
                "where": where in section, "stack": None if frame is None else frame in section,
                "to_report_s": round(report.stat().st_mtime - at, 2) if report.exists() and at else None,
                "to_end_s": round(ended - at, 2) if at else None,
                "median_step_ms": None if median is None else round(median * 1e3, 1)}


# The fault the tests do not judge by the report: MPICH's mpiexec ends the job when a rank is killed
# (and names it: "KILLED BY SIGNAL: 9").
UNJUDGED = [("sigkill", 2, "missing", None)]


def faults(args) -> None:
    for fault, n, where, frame in CASES + UNJUDGED:
        if args.only and fault not in args.only:
            continue
        for size in (args.ranks or [n]):
            _append(run_fault(fault, size, where, frame), args.out)


def cost(args) -> None:
    for n in args.ranks or [2, 4]:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "row.json"
            cmd = launch.mpi_command(n, WORKERS / "recorder_worker.py", "--out", out, "--steps", args.steps,
                                     "--rounds", args.rounds)
            job, result = launch.run_json(cmd, out, launch.job_env(mpich_yield=True), timeout=1800)
            job.check()
            _append({"kind": "cost", **result}, args.out)


def _yes(v) -> str:
    return "-" if v is None else "yes" if v else "**no**"


def _date(r: dict) -> str:
    return r["stamp"]["utc"][:10] if "stamp" in r else r["date"]


def report(args) -> None:
    latest: dict[tuple, dict] = {}
    for r in rows.read(args.out.with_suffix(".jsonl")):  # the latest run of each case
        latest[(r["kind"], r.get("fault"), r["ranks"])] = r
    stamps = sorted({(_date(r), rows.commit_of(r)[:7]) for r in latest.values()})
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
    md = args.out.with_suffix(".md")
    md.write_text("\n".join(out) + "\n")
    print(md.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help="results prefix (default benchmarks/results/hang)")
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
