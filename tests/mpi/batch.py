"""Many cases to one mpiexec job: a worker built on workers/cases.py runs the cases added here one
after another, one job per world size, and each test asks for its own case's outcome.

Starting a job costs a torch import per rank, more than most cases; this keeps that cost to one per
world size and phase, while every case keeps its own test, and a case that fails fails its test
with its own traceback (a case that left other ranks stuck ends the job: the cases after it fail as
not run, with the job's output).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .launcher import ROOT, TIMEOUT, WORKERS, mpi_env, mpiexec


def selected(request) -> list:
    """The tests of the requesting module that this session runs (after -k, -m and deselection), so
    that a module fixture plans the cases of those only."""
    return [item for item in request.session.items if item.path == request.path]


class Batch:
    """The cases of one worker script, run as one job per world size at each ``run()``."""

    def __init__(self, script: str, tmp_path_factory):
        self.script, self.tmp = script, tmp_path_factory
        self._waiting: dict[str, tuple[int, list[str]]] = {}
        self._outcome: dict[str, str | None] = {}  # name -> None (passed) or what went wrong

    def add(self, name: str, world: int, *argv) -> None:
        """Case ``name``: the worker's command line ``argv`` on ``world`` ranks, at the next run()."""
        assert name not in self._waiting and name not in self._outcome, name
        self._waiting[name] = (world, [str(a) for a in argv])

    def run(self) -> None:
        """One job per world size for the cases added since the last run, each in the order added."""
        by_world: dict[int, list[tuple[str, list[str]]]] = {}
        for name, (world, argv) in self._waiting.items():
            by_world.setdefault(world, []).append((name, argv))
        self._waiting = {}
        for world, cases in sorted(by_world.items()):
            self._job(world, cases)

    def check(self, name: str) -> None:
        """Raise the case's own failure, if it had one."""
        outcome = self._outcome[name]
        if outcome is not None:
            raise AssertionError(outcome)

    def _job(self, world: int, cases: list[tuple[str, list[str]]]) -> None:
        where = self.tmp.mktemp(f"{Path(self.script).stem}-np{world}-cases")
        spec = where / "spec.json"
        spec.write_text(json.dumps({"dir": str(where), "cases": [argv for _, argv in cases]}))
        cmd = [*mpiexec(), "-n", str(world), sys.executable, "-m", "mpi4py", str(WORKERS / self.script),
               "--cases", str(spec)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=mpi_env(), cwd=ROOT,
                                  check=False)
            rc, out, err, how = proc.returncode, proc.stdout, proc.stderr, f"exited {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            rc, how = None, f"ran past {TIMEOUT:.0f} s"
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        job = f"the job {' '.join(cmd)} {how}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-8000:]}"
        outcomes = [_outcome(where, i, world, name, argv, job) for i, (name, argv) in enumerate(cases)]
        if rc != 0 and not any(outcomes):  # every case ended well, the job did not (at its exit)
            outcomes = [f"case {name}: every case ended, but {job}" for name, _ in cases]
        self._outcome.update((name, o) for (name, _), o in zip(cases, outcomes))


def _outcome(where: Path, index: int, world: int, name: str, argv: list[str], job: str) -> str | None:
    status = [where / f"{index}.{rank}" for rank in range(world)]
    raised = [f"--- rank {r}\n{p.read_text()}" for r, p in enumerate(status) if p.exists() and p.read_text() != "ok"]
    if raised:
        return f"case {name} ({' '.join(argv)}) raised:\n" + "\n".join(raised)
    if not all(p.exists() for p in status):
        return f"case {name} ({' '.join(argv)}) did not reach its end: {job}"
    return None
