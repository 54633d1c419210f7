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
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, rows, stamp  # noqa: E402
from harness.paths import RESULTS, WORKERS  # noqa: E402

WORKER = WORKERS / "scale_worker.py"


def ranks_per_node(world: int) -> int:
    return 8 if world >= 16 else max(1, world // 2)


def run(world: int, scratch: Path, timeout: float) -> dict:
    out, root = scratch / f"np{world}.json", scratch / f"ckpt{world}"
    shutil.rmtree(root, ignore_errors=True)
    cmd = launch.mpi_command(world, WORKER, "--out", out, "--root", root, "--ranks-per-node", ranks_per_node(world))
    job, result = launch.run_json(cmd, out, launch.job_env(mpich_yield=True), timeout)
    job.check()  # a world size that fails ends the run: the larger ones would fail the same way
    shutil.rmtree(root, ignore_errors=True)
    return result


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
    ap.add_argument("--out", type=Path, default=RESULTS / "scale",
                    help="results prefix: PREFIX.jsonl (appended) and PREFIX.md (default benchmarks/results/scale)")
    args = ap.parse_args()
    if args.report:
        found = rows.read(args.out.with_suffix(".jsonl"))
        report([r for r in found if r["date"] == found[-1]["date"]], args.out)
        return
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="zerompi-scale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    run_id = {"commit": stamp.commit(short=True), "date": stamp.utc_now()}  # the report shows the last run
    with rows.RowLog(args.out.with_suffix(".jsonl"), mode=rows.Mode.APPEND) as log:
        for world in (int(x) for x in args.ranks.split(",")):
            row = log.add({**run_id, **run(world, scratch, args.timeout), "load_average": stamp.loadavg()[0]})
            print(json.dumps(row), flush=True)
    report(log.rows, args.out)


def report(found: list[dict], out: Path) -> None:
    """scale.md: this run's table, then the findings kept in scale_notes.md."""
    first = found[0]
    notes = RESULTS / "scale_notes.md"
    text = [f"# What grows with the number of ranks (commit {first['commit']}, {first['date']})", "",
            "`python benchmarks/bench_scale.py` (rows also in scale.jsonl). One machine, 2 cores, ranks "
            "oversubscribed (they yield while waiting), one torch thread each; 66k-parameter MLP, stage 3, "
            "SGD; nodes emulated with `ranks_per_node` (8, or 2 nodes below 16 ranks). Times: slowest rank; "
            "memory: largest rank, growth from just before `initialize` to after the first step.", "",
            *table(found), ""]
    if notes.exists():
        text += [notes.read_text()]
    markdown.write(out.with_suffix(".md"), "\n".join(text))


if __name__ == "__main__":
    main()
