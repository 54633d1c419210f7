"""Reliability figures: dead or failing ranks, interrupted saves, fuzzed checkpoints and configs.

    python benchmarks/reliability.py [--repeat N] [--random-kills N] [--skip-fuzz] [--out FILE]

1. Rank failures (real mpiexec jobs of tests/mpi/workers/reliability.py): SIGKILL one rank of a
   training job (2 and 3 ranks, a different rank each time) and time from the kill to the job's end;
   an uncaught exception on one rank (plain `python`, zerompi's excepthook) timed from its report to
   the job's end; a rank stuck outside a collective with collective_timeout=3 timed from the
   watchdog's report to the end; every rank's process checked gone.
2. Interrupted saves: the injection of tests/mpi/test_checkpoint.py::test_kill_during_save_keeps_
   latest_loadable at more points (before/after each step of the save protocol, each fsync, each
   rename) and at random moments, for a new tag and for re-saving the tag `latest` names. A saving
   child forked from a trained single-process engine is SIGKILLed there; then `latest` must load
   (every tensor read and verified) with the values of a complete save, every earlier tag must still
   load bitwise, and the next save must succeed and clean up -- nothing lost.
3. Fuzzing: runs tests/unit/checkpoint/test_fuzz_checkpoint.py and tests/unit/config/test_fuzz_config.py with
   ZEROMPI_FUZZ_REPORT and reports their counts.

Writes benchmarks/results/reliability.md (about 3-5 minutes on 2 cores). The parts are in faults/.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from faults.fuzz import fuzz  # noqa: E402
from faults.ranks import rank_failures  # noqa: E402
from faults.report import render  # noqa: E402
from faults.saves import interrupted_saves  # noqa: E402
from harness import markdown, stamp  # noqa: E402


def _mpi_version() -> str:
    from zerompi.tools.mpirun import mpiexec
    exe = mpiexec()
    text = subprocess.run([exe[0], "--version"], capture_output=True, text=True).stdout
    version = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                    if line.strip().startswith("Version:")), "")
    return f"{Path(exe[0]).name} {version}".strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="kills per world size, and tries per save kill point")
    p.add_argument("--random-kills", type=int, default=25, help="kills at random moments per save mode")
    p.add_argument("--skip-fuzz", action="store_true")
    p.add_argument("--skip-ranks", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results" / "reliability.md")
    args = p.parse_args()
    start = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - start:6.1f} s] {msg}", flush=True)

    import h5py
    import torch
    m = stamp.machine()
    meta = {"date": stamp.utc_now()[:10], "machine": m["host"], "cpus": m["cpus"],
            "load": " ".join(f"{x:.1f}" for x in stamp.loadavg()), "commit": stamp.commit(short=True),
            "python": stamp.versions()["python"], "torch": torch.__version__, "h5py": h5py.version.version,
            "hdf5": h5py.version.hdf5_version, "mpiexec": _mpi_version(),
            "args": " ".join(sys.argv[1:])}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="zerompi-reliability-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.skip_ranks:
            results["ranks"] = rank_failures(args.repeat, tmp, log)
        if not args.skip_fuzz:
            results["fuzz"] = fuzz(tmp, log)
        # last: it imports zerompi here and forks the saving children from this process
        results["saves"] = interrupted_saves(max(1, args.repeat - 1), args.random_kills, tmp, log)
    meta["seconds"] = time.monotonic() - start
    markdown.write(args.out, render(results, meta))


if __name__ == "__main__":
    main()
