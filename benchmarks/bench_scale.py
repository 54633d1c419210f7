"""What grows with the number of ranks: initialize, memory beyond the model's shard, checkpoint files,
the index and its load, at 2 ... 64 ranks on one machine.

    python benchmarks/bench_scale.py [--ranks 2,4,8,16,32,64] [--dir DIR]

Ranks oversubscribe the cores: each yields while it waits (MPIR_CVAR_POLLS_BEFORE_YIELD=1), runs one
torch thread, and trains a 66k-parameter MLP at stage 3, so the model's shard is negligible and what
grows is the process's and MPI's own. Nodes are emulated, 8 ranks each (fewer at 2 and 4 ranks:
2 nodes). Each world size is one job (workers/scale_worker.py); rank 0 records the slowest rank's
times and the largest rank's memory. Appends to benchmarks/results/scale.jsonl and rewrites
scale.md from the rows of this run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from zerompi.tools.mpirun import mpi_env, mpiexec  # noqa: E402

RESULTS = HERE / "results"
WORKER = HERE / "workers" / "scale_worker.py"


def ranks_per_node(world: int) -> int:
    return 8 if world >= 16 else max(1, world // 2)


def run(world: int, scratch: Path, timeout: float) -> dict:
    out, root = scratch / f"np{world}.json", scratch / f"ckpt{world}"
    shutil.rmtree(root, ignore_errors=True)
    cmd = [*mpiexec(), "-n", str(world), sys.executable, "-m", "mpi4py", str(WORKER), "--out", str(out),
           "--root", str(root), "--ranks-per-node", str(ranks_per_node(world))]
    proc = subprocess.run(cmd, env=mpi_env(ROOT), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    shutil.rmtree(root, ignore_errors=True)
    return json.loads(out.read_text())


def commit() -> str:
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return git.stdout.strip() or "unknown"


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def table(rows: list[dict]) -> list[str]:
    lines = ["| ranks | nodes | initialize s | initialize CPU s | RSS growth MiB | beyond shard MiB | PSS growth MiB | "
             "private growth MiB | shard KiB | per_rank files | per_node files | index bytes (per_rank / per_node) | "
             "index read ms | save s (per_rank / per_node) | load s (per_rank / per_node) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        pr, pn = r["layouts"]["per_rank"], r["layouts"]["per_node"]
        cpu = f"{r['initialize_cpu_s']:.2f}" if "initialize_cpu_s" in r else "-"
        lines.append(
            f"| {r['world']} | {r['world'] // r['ranks_per_node']} | {r['initialize_s']:.2f} | {cpu} | "
            f"{r['rss_growth_kib'] / 1024:.1f} | {r['rss_beyond_shard_kib'] / 1024:.1f} | "
            f"{r['pss_growth_kib'] / 1024:.1f} | {r['private_growth_kib'] / 1024:.1f} | "
            f"{r['model_state_bytes_per_rank'] / 1024:.0f} | {pr['shard_files']} | {pn['shard_files']} | "
            f"{pr['index_bytes']} / {pn['index_bytes']} | {1000 * pr['index_read_s']:.1f} | "
            f"{pr['save_s']:.2f} / {pn['save_s']:.2f} | {pr['load_s']:.2f} / {pn['load_s']:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8,16,32,64")
    ap.add_argument("--dir", help="scratch directory (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--report", action="store_true", help="only rewrite scale.md from scale.jsonl's last run")
    args = ap.parse_args()
    if args.report:
        rows = [json.loads(line) for line in (RESULTS / "scale.jsonl").read_text().splitlines() if line.strip()]
        report([r for r in rows if r["date"] == rows[-1]["date"]])
        return
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="zerompi-scale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    stamp = {"commit": commit(), "date": datetime.datetime.now().isoformat(timespec="seconds")}
    rows = []
    for world in (int(x) for x in args.ranks.split(",")):
        row = {**stamp, **run(world, scratch, args.timeout), "load_average": load_average()}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with (RESULTS / "scale.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
    report(rows)


def report(rows: list[dict]) -> None:
    """scale.md: this run's table, then the findings kept in scale_notes.md."""
    stamp = rows[0]
    notes = RESULTS / "scale_notes.md"
    text = [f"# What grows with the number of ranks (commit {stamp['commit']}, {stamp['date']})", "",
            "`python benchmarks/bench_scale.py` (rows also in scale.jsonl). One machine, 2 cores, ranks "
            "oversubscribed (they yield while waiting), one torch thread each; 66k-parameter MLP, stage 3, "
            "SGD; nodes emulated with `ranks_per_node` (8, or 2 nodes below 16 ranks). Times: slowest rank; "
            "memory: largest rank, growth from just before `initialize` to after the first step.", "",
            *table(rows), ""]
    if notes.exists():
        text += [notes.read_text()]
    (RESULTS / "scale.md").write_text("\n".join(text))


if __name__ == "__main__":
    main()
