"""Several cases in one MPI job (planned by tests/mpi/batch.py): a job's start-up (a torch import per
rank) costs more than most cases, so a worker runs a list of them one after another.

``main(run)`` calls ``run(argv)`` once with the command line, or, given ``--cases SPEC``, once per
argument list in SPEC (JSON: {"dir": ..., "cases": [argv, ...]}). After case i each rank writes
DIR/i.RANK: "ok", or the traceback of what the case raised, so that a failing case fails its own
test only and the next case runs. A case that raised on some ranks may have left the others inside
one of its collectives: then the job cannot go on, and it is aborted (the cases not reached have no
file, and their tests say so).

A worker that does not call ``main`` itself runs as ``python -m mpi4py cases.py WORKER --cases SPEC``:
each case is then a run of the worker's file as __main__, with the case's command line as sys.argv.
"""
from __future__ import annotations

import json
import runpy
import sys
import time
import traceback
from pathlib import Path

from mpi4py import MPI

STUCK_AFTER = 120.0  # seconds a rank that raised waits for the others to leave the case too


def _all_left(book, patience: float | None) -> bool:
    """Every rank is past the case (a barrier that gives up after ``patience`` seconds)."""
    request, start = book.Ibarrier(), time.monotonic()
    while not request.Test():
        if patience is not None and time.monotonic() - start > patience:
            return False
        time.sleep(0.005)
    return True


def main(run) -> None:
    if sys.argv[1:2] != ["--cases"]:
        run(sys.argv[1:])
        return
    spec = json.loads(Path(sys.argv[2]).read_text())
    book = MPI.COMM_WORLD.Dup()  # the cases' ends only: never matched against a case's own collectives
    rank = book.Get_rank()
    for i, argv in enumerate(spec["cases"]):
        try:
            run(argv)
            status = "ok"
        except (Exception, SystemExit):  # noqa: BLE001 - whatever the case raised is its outcome
            status = traceback.format_exc()
        Path(spec["dir"], f"{i}.{rank}").write_text(status)
        if not _all_left(book, None if status == "ok" else STUCK_AFTER):
            sys.stderr.write(f"rank {rank}: case {i} raised and the other ranks are still inside it\n")
            sys.stderr.flush()
            book.Abort(1)


def _run_file(path: str):
    def run(argv: list[str]) -> None:
        sys.argv = [path, *argv]
        runpy.run_path(path, run_name="__main__")
    return run


if __name__ == "__main__":
    main(_run_file(sys.argv.pop(1)))
