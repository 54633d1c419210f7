"""Capacity: the largest GPT that trains under one memory cap for the whole job.

    python benchmarks/bench_capacity.py [--cap-gib 6] [--ranks 2] [--nvme DIR] [--quick]

Each trial is one MPI job (workers/capacity_worker.py: a GPT built on the meta device,
``zerompi.initialize`` with deferred initialisation, two AdamW steps) started inside a cgroup
whose memory limit covers every process of the job (mpiexec and all ranks; swap is off
here). For each mode (stage 0, stage 3, stage 3 + CPU offload, stage 3 + NVMe offload) the
depth grows along a ladder until a trial is killed by the OOM killer (or fails otherwise);
then the depth is bisected between the last rung that trained and the first that did not,
to about 10%; the largest depth that trained is the mode's capacity. Needs root and a writable cgroup memory
controller (v1 or v2). Results: benchmarks/results/capacity.{json,md,png}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)]
from tests.mpi.launcher import mpi_env, mpiexec  # noqa: E402

log = logging.getLogger("bench_capacity")
GiB, MiB = 1 << 30, 1 << 20
WORKER = HERE / "workers" / "capacity_worker.py"
LADDER = (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160)
MODES = ("stage0", "stage3", "stage3+cpu", "stage3+nvme")


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
    t0 = time.perf_counter()
    try:
        proc = cg.run(cmd, mpi_env(), args.trial_timeout)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        code, tail = None, f"over --trial-timeout {args.trial_timeout} s"
    row = {"mode": mode, "n_layer": n_layer, "seconds": time.perf_counter() - t0, "cgroup_peak": cg.peak(),
           "oom_kills": cg.oom_kills() - kills, "exit": code}
    if code == 0 and out.exists():
        row.update(ok=True, **json.loads(out.read_text()))
    else:
        row.update(ok=False, why="OOM killed" if row["oom_kills"] else "failed", tail=tail)
    shutil.rmtree(nvme, ignore_errors=True)
    return row


def _logged(row: dict) -> dict:
    if row["ok"]:
        peak = f"{row['cgroup_peak'] / GiB:.2f} GiB" if row["cgroup_peak"] else "?"
        log.info("%s, %d layers (%.0fM params): trained, job peak %s, %.0f s", row["mode"], row["n_layer"],
                 row["params"] / 1e6, peak, row["seconds"])
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


def summary(rows: list[dict]) -> dict[str, dict]:
    best = {}
    for mode in MODES:
        ok = [r for r in rows if r["mode"] == mode and r["ok"]]
        failed = sorted((r for r in rows if r["mode"] == mode and not r["ok"]), key=lambda r: r["n_layer"])
        if ok:
            top = max(ok, key=lambda r: r["params"])
            best[mode] = {"n_layer": top["n_layer"], "params": top["params"], "cgroup_peak": top["cgroup_peak"],
                          "step_s": top["step_s"][-1], "first_failure": failed[0]["n_layer"] if failed else None,
                          "why": failed[0]["why"] if failed else "ladder ended"}
    return best


def markdown(data: dict) -> str:
    best, base = data["best"], data["best"].get("stage0", {}).get("params")
    lines = ["# Capacity: the largest GPT that trains under one memory cap", "",
             f"Machine: {data['machine']}. Date {data['date']}, commit {data['commit']}. Run: `{data['command']}`, "
             f"{data['seconds'] / 60:.0f} min.", "",
             f"Cap: {data['cap_gib']:g} GiB for the whole job ({data['ranks']} ranks and mpiexec), a cgroup memory "
             "limit; no swap. Model: GPT, vocab 256, block 64, "
             f"n_embd {data['n_embd']}, {data['n_head']} heads, no biases, depth along the ladder "
             f"{', '.join(map(str, LADDER[:data['max_rungs']]))}; fp32, AdamW, bucket_mb 25, built on the meta device "
             "and initialised bucket by bucket (`param_init=model.init_module`); micro-batch 1 × 64 tokens per "
             "rank, 2 steps. NVMe: zerompi's default swap settings on the machine's disk "
             f"(`{data['nvme_dir']}`).", "",
             "| mode | largest that trained | parameters | × stage 0 | job peak memory | s/step | next rung |",
             "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        b = best.get(mode)
        if b is None:
            lines.append(f"| {mode} | none |  |  |  |  |  |")
            continue
        ratio = f"{b['params'] / base:.1f}×" if base else "?"
        peak = f"{b['cgroup_peak'] / GiB:.2f} GiB" if b["cgroup_peak"] else "?"
        nxt = f"{b['first_failure']} layers: {b['why']}" if b["first_failure"] else b["why"]
        lines.append(f"| {mode} | {b['n_layer']} layers | {b['params'] / 1e6:.0f}M | {ratio} | {peak} | "
                     f"{b['step_s']:.1f} | {nxt} |")
    lines += ["", "Every trial (peak: the cgroup's max usage, all processes of the job):", "",
              "| mode | layers | parameters | result | job peak GiB | peak RSS per rank GiB | s/step | trial s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        rss = "/".join(f"{x['peak_rss'] / GiB:.2f}" for x in r["ranks"]) if r["ok"] else ""
        peak = f"{r['cgroup_peak'] / GiB:.2f}" if r["cgroup_peak"] else ""
        lines.append(f"| {r['mode']} | {r['n_layer']} | {r['params'] / 1e6:.0f}M | trained | {peak} | {rss} | "
                     f"{r['step_s'][-1]:.1f} | {r['seconds']:.0f} |" if r["ok"] else
                     f"| {r['mode']} | {r['n_layer']} |  | {r['why']} (exit {r['exit']}) | {peak} |  |  | "
                     f"{r['seconds']:.0f} |")
    lines += ["", data["reading"], ""]
    return "\n".join(lines)


def reading(data: dict) -> str:
    best = data["best"]
    s0, nv = best.get("stage0", {}).get("params"), best.get("stage3+nvme", {}).get("params")
    text = "Reading: "
    if s0 and nv:
        text += (f"NVMe offload trains {nv / s0:.1f}× the parameters of stage 0 under the same cap "
                 f"(target ≥ 8×)")
        text += (", and it was not stopped by memory: the ladder ended, or the next rung ran out of time "
                 "or disk. " if best["stage3+nvme"]["why"] != "OOM killed" else ". ")
    s3, cpu = best.get("stage3", {}).get("params"), best.get("stage3+cpu", {}).get("params")
    if s3 and cpu:
        text += (f"'cpu' offload trains {cpu / s3:.2f}× what stage 3 trains: on this machine the CPU is the "
                 "device, so it moves nothing out of the memory the cap counts and only adds a separate "
                 "fp32 master (and parameter shard) beside the compute parameters; on a GPU node the same "
                 "setting moves them off the GPU. ")
    text += ("With NVMe offload the model states "
             "resident between uses are none: parameter, gradient and optimizer shards live in the swap "
             "files, and memory holds one gathered unit (plus one read ahead), the optimizer's three "
             "streaming buckets and the swap buffers, whatever the depth; what grows with the model "
             "is the time per step (disk traffic) and the swap files (20 bytes per parameter in fp32: "
             "parameter, master, gradient, two moments).")
    nvme = sorted((r for r in data["rows"] if r["mode"] == "stage3+nvme" and r["ok"] and r["cgroup_peak"]),
                  key=lambda r: r["params"])
    if len(nvme) >= 2:
        a, b = nvme[0], nvme[-1]
        slope = (b["cgroup_peak"] - a["cgroup_peak"]) / (b["params"] - a["params"])
        reach = (data["cap_gib"] * GiB - a["cgroup_peak"]) / slope + a["params"]
        text += (f" The job's peak still rises {slope:.2f} bytes per parameter across the NVMe rows "
                 f"(host-side bookkeeping, not model state); at that rate the cap would be reached near "
                 f"{reach / 1e9:.0f}B parameters, well past what this disk holds or this CPU trains in "
                 "reasonable time.")
    return text


def plot(data: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in MODES:
        ok = [r for r in data["rows"] if r["mode"] == mode and r["ok"]]
        if ok:
            ax.plot([r["params"] / 1e6 for r in ok], [r["cgroup_peak"] / GiB for r in ok], "o-", label=mode)
    ax.axhline(data["cap_gib"], color="k", ls="--", lw=1, label=f"cap {data['cap_gib']:g} GiB")
    ax.set_xscale("log")
    ax.set_xlabel("GPT parameters (millions), each point a run that trained")
    ax.set_ylabel("job peak memory, GiB")
    ax.set_title(f"Capacity under a {data['cap_gib']:g} GiB cap, {data['ranks']} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap-gib", type=float, default=6.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--nvme", type=Path, default=Path(tempfile.gettempdir()), help="disk for the swap files")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-rungs", type=int, default=len(LADDER))
    p.add_argument("--trial-timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="n_embd 256, 1 GiB cap: a check of the harness")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.quick:
        args.n_embd, args.n_head = 256, 8
        args.cap_gib = args.cap_gib if args.cap_gib != 6.0 else 1.5
    t0 = time.perf_counter()
    scratch = args.nvme / f"zerompi-capacity-{os.getpid()}"
    scratch.mkdir(parents=True)
    cg = Cgroup(int(args.cap_gib * GiB))
    rows: list[dict] = []
    try:
        for mode in args.modes.split(","):
            rows += climb(cg, args, mode, scratch)
    finally:
        cg.remove()
        shutil.rmtree(scratch, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    data = {"machine": f"{cpu}, {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.1f} GiB",
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit,
            "command": "python benchmarks/bench_capacity.py" + (" --quick" if args.quick else ""),
            "cap_gib": args.cap_gib, "ranks": args.ranks, "n_embd": args.n_embd, "n_head": args.n_head,
            "max_rungs": args.max_rungs, "nvme_dir": str(args.nvme), "rows": rows,
            "seconds": time.perf_counter() - t0}
    data["best"] = summary(rows)
    data["reading"] = reading(data)
    out = args.out or (Path(tempfile.gettempdir()) / "zerompi-capacity-quick" if args.quick else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps(data, indent=1))
    (out / "capacity.md").write_text(markdown(data))
    plotted = plot(data, out / "capacity.png")
    print(markdown(data))
    print(f"written to {out}" + ("" if plotted else " (no plot: matplotlib is not installed)"))


if __name__ == "__main__":
    main()
