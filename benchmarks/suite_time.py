"""How long the test suite takes, and where: each test module's total of setup, call and teardown.

    python benchmarks/suite_time.py --fast          # runs `pytest -m fast --durations=0` here, now
    python benchmarks/suite_time.py                 # runs the full suite (CI=true), about 25 minutes
    python benchmarks/suite_time.py --log L --commit C   # summarises the log of a run made elsewhere

Results: ``benchmarks/results/suite_time[_fast].{jsonl,md}``, one line per run appended (the stamp says the
commit; a summarised log says the commit it was run at, given by ``--commit``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import stamp  # noqa: E402

DURATION = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(\S+?)::")
SUMMARY = re.compile(r"^=* ?(\d+ (?:failed|passed|error).*) in ([0-9.]+)s")


def summarise(text: str) -> dict:
    """Module totals (seconds, largest first) and pytest's last summary line of a ``--durations=0`` log."""
    modules: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = DURATION.match(line)
        if m:
            modules[m.group(2)] += float(m.group(1))
    done = [m for m in map(SUMMARY.match, text.splitlines()) if m]
    if not done:
        raise SystemExit("no pytest summary line in the log: the run did not finish")
    return {"outcome": done[-1].group(1), "wall_s": float(done[-1].group(2)),
            "modules": dict(sorted(((k, round(v, 1)) for k, v in modules.items()), key=lambda kv: -kv[1]))}


def run(fast: bool) -> tuple[str, float]:
    cmd = [sys.executable, "-m", "pytest", "-q", "--durations=0", *(["-m", "fast"] if fast else [])]
    env = {**os.environ, **({} if fast else {"CI": "true"})}
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc.stdout, time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fast", action="store_true", help="the fast tier (pytest -m fast)")
    p.add_argument("--log", type=Path, help="summarise this pytest --durations=0 log instead of running")
    p.add_argument("--commit", help="with --log: the commit the log's run was at")
    p.add_argument("--source", help="with --log: how the run was made (default: 'log of a run at COMMIT')")
    p.add_argument("--out", type=Path, default=None, help="results prefix")
    a = p.parse_args()
    if a.log is not None and not a.commit:
        p.error("--log needs --commit (the commit the run was at)")
    out = a.out or HERE / "results" / ("suite_time_fast" if a.fast else "suite_time")
    if a.log is not None:
        row = {"source": a.source or f"log of a run at {a.commit}", "commit": a.commit, **summarise(a.log.read_text())}
    else:
        text, wall = run(a.fast)
        row = {"source": "run by this script", "commit": stamp.commit(short=True), "script_wall_s": round(wall, 1),
               **summarise(text)}
    row = {"tier": "fast" if a.fast else "full", "stamp": stamp.stamp(), **row}
    with open(out.with_suffix(".jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    lines = [f"# Test suite time ({rows[-1]['tier']} tier)", "",
             f"`python benchmarks/suite_time.py{' --fast' if a.fast else ''}`; rows: `{out.with_suffix('.jsonl').name}`.",
             "", "| commit | source | outcome | wall | largest modules (s) |", "|---|---|---|---|---|"]
    for r in rows:
        top = ", ".join(f"{Path(k).stem} {v:g}" for k, v in list(r["modules"].items())[:8])
        lines.append(f"| {r['commit']} | {r['source']} | {r['outcome']} | {r['wall_s'] / 60:.2f} min "
                     f"({r['wall_s']:.0f} s) | {top} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(lines[-1])


if __name__ == "__main__":
    main()
