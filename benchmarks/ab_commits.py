"""Step time of two commits, interleaved: does a change that must change nothing keep the speed?

Each side is a worktree of its commit. Round by round, base then head, each runs
``bench_peers.py`` (this tree's harness) with one repeat of the chosen rows, the package imported
from that side's tree (``PYTHONPATH``); every row is its own ``mpiexec`` job. The report gives
each side's per-round step times, the medians, head / base and the base's own spread, and whether
every step's loss is bitwise the same on both sides.

    python benchmarks/ab_commits.py BASE_TREE HEAD_TREE [--rounds 3] [--rows zerompi-1,zerompi-3]
        [--cases 20M:2] [--steps 5] [--out benchmarks/results/renovation3_ab]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, repeats, rows, stamp  # noqa: E402


def commit(tree: Path) -> str:
    return stamp.commit(cwd=tree, short=True)


def one_round(tree: Path, args, out: Path) -> list[dict]:
    # The row runners put ZEROMPI_BENCH_TREE first on sys.path (peers/rowlib.py): PYTHONPATH alone comes after
    # the checkout they live in, so both sides would import this tree's package.
    env = {**os.environ, "PYTHONPATH": str(tree), "ZEROMPI_BENCH_TREE": str(tree)}
    cmd = [sys.executable, str(HERE / "bench_peers.py"), "--cases", args.cases, "--rows", args.rows,
           "--steps", str(args.steps), "--warmup", "1", "--repeats", "1", "--mpich-yield", "--out", str(out)]
    launch.run(cmd, env, timeout=None).check()
    got = rows.split(rows.read(out.with_suffix(".jsonl")))[1]
    wrong = {r.get("package") for r in got if r.get("package") not in (None, str(tree))}
    if wrong:  # a row that ran another tree's package would make the comparison meaningless
        raise SystemExit(f"{tree}: rows imported zerompi from {sorted(map(str, wrong))}, not from the tree")
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path)
    p.add_argument("head", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", default="zerompi-1,zerompi-3")
    p.add_argument("--cases", default="20M:2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=HERE / "results" / "renovation3_ab")
    args = p.parse_args(argv)
    sides = {"base": args.base.resolve(), "head": args.head.resolve()}
    runs: dict[str, list[list[dict]]] = {"base": [], "head": []}
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        for k, (side, tree) in repeats.interleaved(list(sides.items()), args.rounds):
            runs[side].append(one_round(tree, args, Path(tmp) / f"{side}-{k}"))
            print(f"round {k + 1} {side}: done", file=sys.stderr)
    ended = datetime.datetime.now(datetime.timezone.utc)
    rows = [r["row"] for r in runs["base"][0]]
    lines = [f"# Step time before and after ({commit(sides['base'])} -> {commit(sides['head'])})", "",
             f"`benchmarks/ab_commits.py`: `bench_peers.py` rows {args.rows}, case {args.cases}, 1 warm-up and "
             f"{args.steps} timed steps per job, {args.rounds} rounds interleaved base/head (each job its own "
             f"`mpiexec`), {started:%Y-%m-%d %H:%M}-{ended:%H:%M} UTC, {os.cpu_count()} cores. Base: "
             f"{commit(sides['base'])}; head: {commit(sides['head'])}.", "",
             "| row | base (s/step, per round) | head (s/step, per round) | head / base (medians) | base spread |",
             "|---|---|---|---|---|"]
    verdicts = []
    for row in rows:
        got = {s: [next(r for r in rnd if r["row"] == row) for rnd in runs[s]] for s in runs}
        times = {s: [r.get("step_s_median") for r in got[s]] for s in got}
        if any(t is None for s in times for t in times[s]):
            lines.append(f"| {row} | failed: {[r.get('error') for r in got['base'] + got['head'] if r.get('error')]} | | | |")
            continue
        mb, mh = statistics.median(times["base"]), statistics.median(times["head"])
        spread = (max(times["base"]) - min(times["base"])) / mb
        ratio = mh / mb
        verdicts.append(abs(ratio - 1) <= spread)
        same = all(json.dumps(b.get("losses")) == json.dumps(h.get("losses")) for b in got["base"] for h in got["head"])
        lines.append(f"| {row} | {', '.join(f'{t:.3f}' for t in times['base'])} | "
                     f"{', '.join(f'{t:.3f}' for t in times['head'])} | {ratio:.3f} | {spread:.1%} |")
        lines.append(f"|  | losses bitwise equal on both sides: {same} | | | |")
    lines += ["", "At parity" + ("" if all(verdicts) else " NOT") + " for every row: head / base lies within the base "
              "rounds' own spread (max - min over median)." if verdicts else "No row ran."]
    markdown.write(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
