"""The example jobs (jobs/*.py) as cases of one MPI job (workers/cases.py), each as ``mpiexec -n N
python -m mpi4py jobs/X.py ARGS`` would run it: a case is ``PREFIX SCRIPT ARGS...``, and the script's
``main(ARGS)`` runs with this rank's file descriptors 1 and 2 (so logging and C code too) going to
PREFIX.RANK.out and PREFIX.RANK.err. The engines a job leaves open, as its process's exit would have
ended them, are closed after it.
"""
import os
import runpy
import sys
from contextlib import contextmanager
from pathlib import Path

from mpi4py import MPI

import cases
import zerompi

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "jobs"))  # the jobs' own common.py, as when a job runs as __main__


@contextmanager
def redirected(prefix: str):
    rank = MPI.COMM_WORLD.Get_rank()
    sys.stdout.flush()
    sys.stderr.flush()
    kept = [os.dup(1), os.dup(2)]
    try:
        for fd, kind in ((1, "out"), (2, "err")):
            with open(f"{prefix}.{rank}.{kind}", "w") as f:
                os.dup2(f.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), kept):
            os.dup2(old, fd)
            os.close(old)


@contextmanager
def engines_closed_after():
    """Every engine zerompi.initialize starts inside is closed at the end, unless the job closed it."""
    initialize, left_open = zerompi.initialize, []

    def tracked(*args, **kwargs):
        engine = initialize(*args, **kwargs)
        left_open.append(engine)
        close = engine.close

        def closing(*a, **k):
            left_open.remove(engine)
            return close(*a, **k)
        engine.close = closing
        return engine
    zerompi.initialize = tracked
    failed = True
    try:
        yield
        failed = False
    finally:
        zerompi.initialize = initialize
        for engine in list(left_open):
            engine.close(abandon=failed)  # after a failure nothing communicates


def run(argv: list[str]) -> None:
    prefix, script, *args = argv
    with engines_closed_after(), redirected(prefix):
        runpy.run_path(str(ROOT / script), run_name="job_case")["main"](args)


if __name__ == "__main__":
    cases.main(run)
