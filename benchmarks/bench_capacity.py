"""Capacity: the largest GPT that trains under one memory cap for the whole job.

    python benchmarks/bench_capacity.py [--cap-gib 6] [--ranks 2] [--nvme DIR] [--quick]
    python benchmarks/bench_capacity.py --modes stage3+cpu --merge [--reading NOTE.md]
    python benchmarks/bench_capacity.py --report-only

Each trial is one MPI job (workers/capacity_worker.py: a GPT built on the meta device,
``zerompi.initialize`` with deferred initialisation, two AdamW steps) started inside a cgroup
whose memory limit covers every process of the job (mpiexec and all ranks; swap is off
here). For each mode (stage 0, stage 3, stage 3 + CPU offload, stage 3 + NVMe offload) the
depth grows along a ladder until a trial is killed by the OOM killer (or fails otherwise);
then the depth is bisected between the last rung that trained and the first that did not,
to about 10%; the largest depth that trained is the mode's capacity. Needs root and a writable cgroup memory
controller (v1 or v2). Results: benchmarks/results/capacity.{json,md,png}, all generated
(capacity_report.py): each mode records the commit, date and load average of its measurement;
``--merge`` re-measures the modes given and keeps the file's others; ``--report-only`` rewrites the
md and png from the json; ``--reading FILE`` attaches a markdown note to the modes measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]
from capacity_report import CONFIG, LADDER, MODES, check_merge, git_state, load, machine, merge, write  # noqa: E402
from zerompi.tools.mpirun import mpiexec  # noqa: E402
from zerompi.tools.mpirun import mpi_env as _mpi_env  # noqa: E402

log = logging.getLogger("bench_capacity")
GiB = 1 << 30
WORKER = HERE / "workers" / "capacity_worker.py"


class Cgroup:
    """A memory-limited cgroup (v1 ``memory`` controller or v2) for one job at a time."""

    def __init__(self, limit: int):
        v1 = Path("/sys/fs/cgroup/memory")
        self.v2 = not v1.is_dir()
        base = Path("/sys/fs/cgroup") if self.v2 else v1
        self.path = base / f"zerompi-capacity-{os.getpid()}"
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit))

    def reset_peak(self) -> None:
        if not self.v2:
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def peak(self) -> int | None:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        f = self.path / name
        return int(f.read_text()) if f.exists() else None

    def oom_kills(self) -> int:
        if self.v2:
            events = dict(ln.split() for ln in (self.path / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0))
        control = dict(ln.split() for ln in (self.path / "memory.oom_control").read_text().splitlines())
        return int(control.get("oom_kill", 0))

    def run(self, cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        # The shell joins the cgroup, then becomes the job: every process it starts is inside.
        wrapped = ["bash", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "job", *cmd]
        return subprocess.run(wrapped, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError as e:
            log.warning("could not remove %s: %s", self.path, e)


def trial(cg: Cgroup, args, mode: str, n_layer: int, scratch: Path) -> dict:
    out = scratch / "trial.json"
    out.unlink(missing_ok=True)
    nvme = scratch / "swap"
    shutil.rmtree(nvme, ignore_errors=True)
    nvme.mkdir()
    cmd = [*mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "mpi4py", str(WORKER), "--mode", mode,
           "--n-layer", str(n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
           "--nvme", str(nvme), "--out", str(out)]
    cg.reset_peak()
    kills = cg.oom_kills()
    loadavg = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = cg.run(cmd, _mpi_env(ROOT), args.trial_timeout)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        code, tail = None, f"over --trial-timeout {args.trial_timeout} s"
    row = {"mode": mode, "n_layer": n_layer, "seconds": time.perf_counter() - t0, "cgroup_peak": cg.peak(),
           "oom_kills": cg.oom_kills() - kills, "exit": code, "loadavg": loadavg}
    if code == 0 and out.exists():
        row.update(ok=True, **json.loads(out.read_text()))
    else:
        row.update(ok=False, why="OOM killed" if row["oom_kills"] else "failed", tail=tail)
    shutil.rmtree(nvme, ignore_errors=True)
    return row


def _logged(row: dict) -> dict:
    if row["ok"]:
        peak = f"{row['cgroup_peak'] / GiB:.2f} GiB" if row["cgroup_peak"] else "?"
        moved = [x.get("swap_bytes_per_step", [[0, 0]])[-1] for x in row["ranks"]]
        log.info("%s, %d layers (%.0fM params): trained, job peak %s, %.0f s; last step %.1f s, swap %.2f GiB read, "
                 "%.2f GiB written (sum of ranks)", row["mode"], row["n_layer"], row["params"] / 1e6, peak,
                 row["seconds"], row["step_s"][-1], sum(m[0] for m in moved) / GiB, sum(m[1] for m in moved) / GiB)
    else:
        log.info("%s, %d layers: %s (exit %s), %.0f s", row["mode"], row["n_layer"], row["why"], row["exit"],
                 row["seconds"])
    return row


def climb(cg: Cgroup, args, mode: str, scratch: Path) -> list[dict]:
    """Up the ladder to the first failure, then bisect the depth to about 10%."""
    rows, ok, bad = [], 0, None
    for n_layer in LADDER[:args.max_rungs]:
        rows.append(_logged(trial(cg, args, mode, n_layer, scratch)))
        if not rows[-1]["ok"]:
            bad = n_layer
            break
        ok = n_layer
    while bad is not None and ok and bad - ok > max(1, ok // 10):
        mid = (ok + bad) // 2
        rows.append(_logged(trial(cg, args, mode, mid, scratch)))
        ok, bad = (mid, bad) if rows[-1]["ok"] else (ok, mid)
    return rows


def measure(args, modes: list[str], command: str, reading: str | None) -> dict:
    """Climb each mode; a results dict whose measurements name the commit and load they ran at."""
    scratch = args.nvme / f"zerompi-capacity-{os.getpid()}"
    scratch.mkdir(parents=True)
    cg = Cgroup(int(args.cap_gib * GiB))
    data = {"schema": 2, **{k: getattr(args, k) for k in CONFIG}, "measurements": {}, "rows": []}
    before = os.getloadavg()  # later modes' start loads include this run's earlier trials
    try:
        for mode in modes:
            commit, dirty = git_state()
            m = {"commit": commit, "dirty": dirty, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "command": command, "machine": machine(), "cores": os.cpu_count(), "nvme_dir": str(args.nvme),
                 "loadavg_before_run": before,
                 "loadavg_start": os.getloadavg(), "reading": reading, "previous": None}
            if mode == "stage3+nvme":  # what the disk moves, for each trial's traffic limit (capacity_report)
                from bench_offload import raw_disk
                samples = raw_disk(scratch, 512 << 20, 2)
                m["raw_disk"] = {k: statistics.median(x[k] for x in samples) for k in ("read", "write")}
            t0 = time.perf_counter()
            data["rows"] += climb(cg, args, mode, scratch)
            end_commit, end_dirty = git_state()
            if end_commit != commit:  # later trials may have run the newer code: kept beside the commit
                log.warning("HEAD moved from %s to %s during %s", commit, end_commit, mode)
            m.update(seconds=time.perf_counter() - t0, loadavg_end=os.getloadavg(),
                     commit_end=end_commit, dirty=sorted(set(dirty) | set(end_dirty)))
            if m["dirty"]:
                log.warning("%s ran with uncommitted changes: %s", mode, "; ".join(m["dirty"]))
            data["measurements"][mode] = m
    finally:
        cg.remove()
        shutil.rmtree(scratch, ignore_errors=True)
    return data


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-gib", type=float, default=6.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--nvme", type=Path, default=Path(tempfile.gettempdir()), help="disk for the swap files")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    p.add_argument("--max-rungs", type=int, default=len(LADDER))
    p.add_argument("--trial-timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="n_embd 256, 1.5 GiB cap: a check of the harness")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--merge", action="store_true",
                   help="replace only the measured modes in the folder's capacity.json, keep the others")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rewrite capacity.md and .png from capacity.json")
    p.add_argument("--reading", type=Path, default=None,
                   help="markdown note stored with the modes measured (with --report-only: with --modes)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown mode(s) {', '.join(unknown)}; modes: {', '.join(MODES)}")
    if args.quick:
        args.n_embd, args.n_head = 256, 8
        args.cap_gib = args.cap_gib if args.cap_gib != 6.0 else 1.5
    out = args.out or (Path(tempfile.gettempdir()) / "zerompi-capacity-quick" if args.quick else HERE / "results")
    command = " ".join(["python benchmarks/bench_capacity.py", *map(shlex.quote, argv)])
    reading = args.reading.read_text() if args.reading else None
    existing = out / "capacity.json"
    if (args.report_only or args.merge) and not existing.exists():
        p.error(f"no {existing} to {'report' if args.report_only else 'merge into'}")
    if args.report_only:
        data = load(existing)
        if missing := [m for m in modes if reading is not None and m not in data["measurements"]]:
            p.error(f"--reading: {existing} has no measurement of {', '.join(missing)}")
        for mode in modes if reading is not None else ():
            data["measurements"][mode]["reading"] = reading
    else:
        if set(modes) != set(MODES) and not args.merge and existing.exists():
            p.error(f"{existing} exists and --modes leaves some out: --merge keeps its other modes, "
                    "--out writes elsewhere")
        if args.merge:  # before measuring: the file's cap, model and ladder must be this run's
            check_merge(load(existing), {k: getattr(args, k) for k in CONFIG})
        data = measure(args, modes, command, reading)
        if args.merge:
            data = merge(load(existing), data)
    print(write(data, out, command))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
