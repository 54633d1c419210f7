"""Capacity: the largest model that trains under one memory cap for the whole job.

    python benchmarks/bench_capacity.py [--cap-gib 6] [--ranks 2] [--nvme DIR] [--quick]
    python benchmarks/bench_capacity.py --modes stage3+cpu --merge [--reading NOTE.md]
    python benchmarks/bench_capacity.py --report-only
    benchmarks/.venv-peers/bin/python benchmarks/bench_capacity.py --lora [--modes ...] [--mode-budget-min 60]

Each trial is one MPI job started inside a cgroup whose memory limit covers every process of the
job (mpiexec and all ranks; swap is off here). Two ladders (capacity_report.Study):

- full training (default; workers/capacity_worker.py): a GPT built on the meta device,
  ``zerompi.initialize`` with deferred initialisation, two AdamW steps; modes stage 0, stage 3,
  stage 3 + CPU offload, stage 3 + NVMe offload. Results: benchmarks/results/capacity.{json,md,png}.
- ``--lora`` (workers/lora_worker.py): LoRA adapters (peft) on a frozen Llama-style base in bf16,
  two steps; the zerompi modes and DeepSpeed ZeRO-3 with its default and its lean memory settings, and
  lean with CPU or NVMe offload (run it with the peers venv's Python, benchmarks/setup_peers.sh, for those).
  Results: benchmarks/results/lora_capacity.{json,md,png}.

For each mode the depth grows along the ladder, and on past its end by its last step, until a
trial fails. A trial killed by the OOM killer is bisected against the last rung that trained, to
about 10%; any other end (an error, a trial past ``--trial-timeout``, a rung whose swap files would
not fit on the disk, or one predicted to overrun ``--mode-budget-min``) stops the mode there, with
the reason recorded. The largest depth
that trained is the mode's capacity. Needs root and a writable cgroup memory controller (v1 or v2).
All results files are generated (capacity_report.py): each mode records the commit, date and load
average of its measurement; ``--merge`` re-measures the modes given and keeps the file's others;
``--report-only`` rewrites the md and png from the json; ``--reading FILE`` attaches a markdown note
to the modes measured.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shlex
import shutil
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]
from capacity_report import Study, check_merge, git_state, load, merge, write  # noqa: E402
from gpt_report import GPT  # noqa: E402
from harness import launch, stamp  # noqa: E402
from lora_report import LORA  # noqa: E402

log = logging.getLogger("bench_capacity")
GiB = 1 << 30
STUDIES = {s.key: s for s in (GPT, LORA)}


class Cgroup:
    """A memory-limited cgroup (v1 ``memory`` controller or v2) for one job at a time."""

    def __init__(self, limit: int, name: str = "job"):
        v1 = Path("/sys/fs/cgroup/memory")
        self.v2 = not v1.is_dir()
        base = Path("/sys/fs/cgroup") if self.v2 else v1
        self.path = base / f"zerompi-capacity-{os.getpid()}-{name}"
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

    def run(self, cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
        """The job's exit code and output; past ``timeout`` seconds every process in the cgroup is
        killed and the code is None."""
        # The shell joins the cgroup, then becomes the job: every process it starts is inside.
        wrapped = ["bash", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "job", *cmd]
        proc = subprocess.Popen(wrapped, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out = proc.communicate(timeout=timeout)[0]
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            self.kill()
            return None, proc.communicate()[0]

    def kill(self) -> None:
        """SIGKILL to every process of the job (all of them are in this cgroup), then wait for it to empty."""
        for _ in range(100):
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        log.warning("processes left in %s after SIGKILL", self.path)

    def remove(self) -> None:
        for attempt in range(50):  # the job's last processes may still be exiting
            try:
                self.path.rmdir()
                return
            except OSError as e:
                if attempt == 49:
                    log.warning("could not remove %s: %s", self.path, e)
                time.sleep(0.1)


def trial(cg: Cgroup, args, mode: str, n_layer: int, scratch: Path) -> dict:
    out = scratch / "trial.json"
    out.unlink(missing_ok=True)
    nvme = scratch / "swap"
    shutil.rmtree(nvme, ignore_errors=True)
    nvme.mkdir()
    model = [a for k, v in args.model.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    cmd = launch.mpi_command(args.ranks, HERE / "workers" / args.study.worker, "--mode", mode, "--n-layer", n_layer,
                             *model, "--nvme", nvme, "--out", out)
    # the DeepSpeed modes rendezvous over gloo on loopback; the zerompi modes ignore these
    env = launch.job_env(mpich_yield=True, rendezvous=True,
                         extra={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore::FutureWarning"})
    # the venv's bin first, as setup_peers.sh builds DeepSpeed's ops: torch's loader runs the first
    # `ninja` on PATH, and another ninja version rebuilds the op inside the trial
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cg.reset_peak()
    kills = cg.oom_kills()
    loadavg = stamp.loadavg()[0]
    t0 = time.perf_counter()
    code, output = cg.run(cmd, env, args.trial_timeout)
    row = {"mode": mode, "n_layer": n_layer, "seconds": time.perf_counter() - t0, "cgroup_peak": cg.peak(),
           "oom_kills": cg.oom_kills() - kills, "exit": code, "loadavg": loadavg}
    if code == 0 and out.exists():
        row.update(ok=True, **json.loads(out.read_text()))
    else:
        why = ("OOM killed" if row["oom_kills"] else "failed") if code is not None else \
            f"over --trial-timeout {args.trial_timeout:g} s"
        row.update(ok=False, why=why, tail=output[-1500:])
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
        log.info("%s, %d layers: %s (exit %s), %.0f s", row["mode"], row["n_layer"], row["why"], row.get("exit"),
                 row["seconds"])
    return row


def not_run(args, rows: list[dict], n_layer: int, scratch: Path, elapsed: float) -> str | None:
    """Why ``n_layer`` must not be tried, judged from the mode's largest trial that trained (scaled by
    depth): its swap files would not fit on the disk beside ``--disk-reserve-gib``, or it would end past
    the mode's ``--mode-budget-min``. None: try it."""
    done = [r for r in rows if r["ok"]]
    if not done:
        return None
    last = max(done, key=lambda r: r["n_layer"])
    scale = n_layer / last["n_layer"]
    need = 1.1 * scale * sum(r.get("swapped_bytes") or 0 for r in last["ranks"])
    free = shutil.disk_usage(scratch).free - args.disk_reserve_gib * GiB
    if need > free:
        return (f"not run: its swap files would take about {need / GiB:.0f} GiB; {max(free, 0) / GiB:.0f} GiB "
                f"free on {args.nvme} beyond the {args.disk_reserve_gib:g} GiB left to others")
    predicted = scale * last["seconds"]
    if args.mode_budget_min and elapsed + predicted > 60 * args.mode_budget_min:
        return (f"not run: about {predicted / 60:.0f} min predicted, past the mode's {args.mode_budget_min:g} min "
                f"(--mode-budget-min) after {elapsed / 60:.0f} min")
    return None


def _attempt(cg: Cgroup, args, mode: str, n_layer: int, scratch: Path, rows: list[dict], t0: float) -> dict:
    """One trial, or a row saying why it was not run."""
    why = not_run(args, rows, n_layer, scratch, time.perf_counter() - t0)
    if why is None:
        return _logged(trial(cg, args, mode, n_layer, scratch))
    return _logged({"mode": mode, "n_layer": n_layer, "ok": False, "why": why, "seconds": 0.0,
                    "cgroup_peak": None, "oom_kills": 0, "loadavg": stamp.loadavg()[0]})


def depths(ladder: tuple[int, ...], max_rungs: int, beyond: bool = True) -> Iterator[int]:
    """The ladder's first ``max_rungs`` rungs; when that is all of them (and ``beyond``), on past its
    end by its last step until the climb stops it (a failure, or a rung not run for disk or time): a
    mode that outgrows the ladder is measured at its real limit, not at the ladder's end."""
    yield from ladder[:max_rungs]
    if beyond and max_rungs >= len(ladder) >= 2:
        yield from itertools.count(2 * ladder[-1] - ladder[-2], ladder[-1] - ladder[-2])


def climb(cg: Cgroup, args, mode: str, scratch: Path) -> list[dict]:
    """Up the ladder to the first failure; after an OOM kill, bisect the depth to about 10% (any other
    end says nothing about memory, so the mode stops there)."""
    rows, ok, bad, t0 = [], 0, None, time.perf_counter()
    for n_layer in depths(args.study.ladder, args.max_rungs, beyond=not args.quick):  # --quick: the harness only
        rows.append(_attempt(cg, args, mode, n_layer, scratch, rows, t0))
        if not rows[-1]["ok"]:
            bad = n_layer if rows[-1]["why"] == "OOM killed" else None
            break
        ok = n_layer
    while bad is not None and ok and bad - ok > max(1, ok // 10):
        mid = (ok + bad) // 2
        rows.append(_attempt(cg, args, mode, mid, scratch, rows, t0))
        if not rows[-1]["ok"] and rows[-1]["why"] != "OOM killed":
            break
        ok, bad = (mid, bad) if rows[-1]["ok"] else (ok, mid)
    return rows


def warm_up(args, mode: str, scratch: Path) -> None:
    """One trial of ``mode`` on the quick model, outside the cap, its result dropped: what a framework
    builds on its first start (DeepSpeed compiles an op) is then not built inside a measured trial."""
    quick = argparse.Namespace(**{**vars(args), "model": dict(args.study.quick), "trial_timeout": 1800})
    cg = Cgroup(1 << 40, "warm-up")  # a limit that never counts
    try:
        row = trial(cg, quick, mode, args.study.ladder[0], scratch)
    finally:
        cg.remove()
    log.info("%s warm-up (quick model, no cap): %s", mode, "done" if row["ok"] else f"{row['why']}\n{row['tail']}")


def measure(args, modes: list[str], command: str, reading: str | None) -> dict:
    """Climb each mode; a results dict whose measurements name the commit and load they ran at."""
    scratch = args.nvme / f"zerompi-capacity-{os.getpid()}"
    scratch.mkdir(parents=True)
    cg = Cgroup(int(args.cap_gib * GiB))
    data = {"schema": 2, "study": args.study.key, **config_of(args), "measurements": {}, "rows": []}
    before = stamp.loadavg()  # later modes' start loads include this run's earlier trials
    try:
        for mode in modes:
            commit, dirty = git_state(args.study.sources)
            m = {"commit": commit, "dirty": dirty, "date": stamp.utc_now(), "command": command,
                 "machine": stamp.machine_line(), "cores": stamp.machine()["cpus"], "nvme_dir": str(args.nvme),
                 "loadavg_before_run": before, "loadavg_start": stamp.loadavg(), "reading": reading,
                 "previous": None, "stamp": stamp.stamp()}
            if mode.endswith("+nvme"):  # what the disk moves, for each trial's traffic limit (capacity_report)
                from bench_offload import raw_disk
                samples = raw_disk(scratch, 512 << 20, 2)
                m["raw_disk"] = {k: statistics.median(x[k] for x in samples) for k in ("read", "write")}
            if mode in args.study.warm_up:
                warm_up(args, mode, scratch)
            t0 = time.perf_counter()
            data["rows"] += climb(cg, args, mode, scratch)
            end_commit, end_dirty = git_state(args.study.sources)
            if end_commit != commit:  # later trials may have run the newer code: kept beside the commit
                log.warning("HEAD moved from %s to %s during %s", commit, end_commit, mode)
            m.update(seconds=time.perf_counter() - t0, loadavg_end=stamp.loadavg(),
                     commit_end=end_commit, dirty=sorted(set(dirty) | set(end_dirty)))
            if m["dirty"]:
                log.warning("%s ran with uncommitted changes: %s", mode, "; ".join(m["dirty"]))
            data["measurements"][mode] = m
    finally:
        cg.remove()
        shutil.rmtree(scratch, ignore_errors=True)
    return data


def config_of(args) -> dict:
    return {"cap_gib": args.cap_gib, "ranks": args.ranks, **args.model, "max_rungs": args.max_rungs}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lora", action="store_true", help="the LoRA ladder (lora_capacity.*) instead of the GPT's")
    p.add_argument("--cap-gib", type=float, default=6.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=None, help="GPT width (default 1024)")
    p.add_argument("--n-head", type=int, default=None, help="GPT heads (default 16)")
    p.add_argument("--nvme", type=Path, default=Path(tempfile.gettempdir()), help="disk for the swap files")
    p.add_argument("--modes", default=None, help="comma-separated (default: all of the ladder's modes)")
    p.add_argument("--max-rungs", type=int, default=None, help="climb at most this many rungs of the ladder")
    p.add_argument("--trial-timeout", type=float, default=900)
    p.add_argument("--mode-budget-min", type=float, default=0,
                   help="do not start a trial predicted to end past this many minutes of its mode (0: no limit)")
    p.add_argument("--disk-reserve-gib", type=float, default=8.0,
                   help="do not start a trial whose swap files would leave less free disk than this")
    p.add_argument("--quick", action="store_true", help="a small model and a 1.5 GiB cap: a check of the harness")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--merge", action="store_true",
                   help="replace only the measured modes in the folder's results file, keep the others")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rewrite the md and png from the json")
    p.add_argument("--reading", type=Path, default=None,
                   help="markdown note stored with the modes measured (with --report-only: with --modes)")
    args = p.parse_args(argv)
    study: Study = STUDIES["lora" if args.lora else "gpt"]
    args.study = study
    args.model = dict(study.quick if args.quick else study.model)
    for key in ("n_embd", "n_head"):
        if getattr(args, key) is not None:
            if key not in args.model:
                p.error(f"--{key.replace('_', '-')} sets the GPT ladder's model, not the {study.key} ladder's")
            args.model[key] = getattr(args, key)
    if args.quick:
        args.cap_gib = args.cap_gib if args.cap_gib != 6.0 else 1.5
    args.max_rungs = len(study.ladder) if args.max_rungs is None else args.max_rungs
    args.modes = args.modes.split(",") if args.modes else list(study.modes)
    if unknown := [m for m in args.modes if m not in study.modes]:
        p.error(f"unknown mode(s) {', '.join(unknown)}; modes: {', '.join(study.modes)}")
    return args, p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args, p = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    study, modes = args.study, args.modes
    out = args.out or (Path(tempfile.gettempdir()) / f"zerompi-{study.stem}-quick" if args.quick else HERE / "results")
    command = " ".join(["python benchmarks/bench_capacity.py", *map(shlex.quote, argv)])
    reading = args.reading.read_text() if args.reading else None
    existing = out / f"{study.stem}.json"
    if (args.report_only or args.merge) and not existing.exists():
        p.error(f"no {existing} to {'report' if args.report_only else 'merge into'}")
    if args.report_only:
        data = load(existing, study)
        if data.get("study", "gpt") != study.key:
            p.error(f"{existing} holds the {data.get('study', 'gpt')} ladder, not the {study.key} one")
        if missing := [m for m in modes if reading is not None and m not in data["measurements"]]:
            p.error(f"--reading: {existing} has no measurement of {', '.join(missing)}")
        for mode in modes if reading is not None else ():
            data["measurements"][mode]["reading"] = reading
    else:
        if set(modes) != set(study.modes) and not args.merge and existing.exists():
            p.error(f"{existing} exists and --modes leaves some out: --merge keeps its other modes, "
                    "--out writes elsewhere")
        if args.merge:  # before measuring: the file's cap, model and ladder must be this run's
            check_merge(study, load(existing, study), config_of(args))
        data = measure(args, modes, command, reading)
        if args.merge:
            data = merge(study, load(existing, study), data)
    print(write(study, data, out, command))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
