"""Bitwise fingerprints of training results, for refactors that must change nothing.

    python tests/fingerprint.py --write before.json     # at the commit before the change
    python tests/fingerprint.py --check before.json     # after it: every digest must be equal

Runs workers/parity.py (stages 0-3 x fp32/bf16 x accumulation x clipping x
AdamW/SGD) on 1-4 ranks, with overlap progressed by MPI_Test and by the
communication thread, and under hsdp and hpz groups, and records a SHA-256 of
each run's final parameters and losses. Digests depend on the CPU's kernels, so
compare files written on the same machine; this is a development check, not a
test the suite runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi.launcher import run_worker_json  # noqa: E402

RUNS = {f"flat-np{n}": (n, ()) for n in (1, 2, 3, 4)}
RUNS.update({"overlap-test-np3": (3, ("--overlap", "test")), "overlap-thread-np2": (2, ("--overlap", "thread")),
             "hsdp-np4x2": (4, ("--hierarchy", "hsdp", "--ranks-per-node", "2")),
             "hpz-np4x2": (4, ("--hierarchy", "hpz", "--ranks-per-node", "2"))})


def fingerprints(runs: list[str]) -> dict[str, str]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in runs:
            n, args = RUNS[name]
            for r in run_worker_json(n, "parity.py", Path(tmp) / f"{name}.json", *args, timeout=1800):
                key = f"{name}/stage{r['stage']}-{r['dtype']}-accum{r['accum']}-clip{r['clip']}-{r['optimizer']}"
                out[key] = r["digest"]
            print(f"{name}: done", file=sys.stderr)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path)
    mode.add_argument("--check", type=Path)
    p.add_argument("--runs", default=",".join(RUNS), help="comma list of " + ", ".join(RUNS))
    args = p.parse_args(argv)
    got = fingerprints(args.runs.split(","))
    if args.write:
        args.write.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"{len(got)} fingerprints written to {args.write}")
        return 0
    want = json.loads(args.check.read_text())
    changed = sorted(k for k in got if k in want and got[k] != want[k])
    missing = sorted(k for k in want if k not in got and k.split("/")[0] in args.runs.split(","))
    for k in changed:
        print(f"CHANGED {k}")
    for k in missing:
        print(f"MISSING {k}")
    print(f"{len(got) - len(changed)} of {len(got)} bitwise equal")
    return 1 if changed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
