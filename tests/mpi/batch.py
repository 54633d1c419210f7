"""Many cases to one mpiexec job: a worker built on workers/cases.py runs the cases added here one
after another, one job per world size where their dependencies allow, and each test asks for its own
case's outcome.

Starting a job costs a torch import per rank, more than most cases; this keeps that cost to one per
world size and phase, while every case keeps its own test, and a case that fails fails its test
with its own traceback (a case that left other ranks stuck ends the job: the cases after it fail as
not run, with the job's output).
"""
from __future__ import annotations

import json
import re
import subprocess
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .launcher import ROOT, TIMEOUT, WORKERS, mpi_env, mpiexec, rank_python


def selected(request) -> list:
    """The tests of the requesting module that this session runs (after -k, -m and deselection), so
    that a module fixture plans the cases of those only."""
    return [item for item in request.session.items if item.path == request.path]


def run_planned(request, batch: Batch, plans: dict, *shared):
    """Plan and run the cases of the module's selected tests named in ``plans``: each gets a directory
    ``where``, and ``plans[test](add, where, *shared, **its parameters)`` adds its cases through
    ``add(world, *argv, after=(), prepare=None)``, which returns the case's name. Returns ``ran``:
    ``ran(request)`` raises the test's cases' failures, else returns its directory."""
    planned, where = {}, {}
    for item in (i for i in selected(request) if i.originalname in plans):
        names = planned[item.name] = []
        where[item.name] = batch.tmp.mktemp(re.sub(r"\W", "_", item.name[-40:]))
        plans[item.originalname](_adder(batch, names, item.name), where[item.name], *shared,
                                 **(item.callspec.params if hasattr(item, "callspec") else {}))
    batch.run()

    def ran(req) -> Path:
        for name in planned.get(req.node.name, ()):
            batch.check(name)
        return where[req.node.name]
    return ran


def _adder(batch: Batch, names: list[str], test: str):
    def add(world, *argv, **kw):
        names.append(f"{test}:{len(names)}")
        batch.add(names[-1], world, *argv, **kw)
        return names[-1]
    return add


@dataclass
class Case:
    world: int
    argv: list[str]
    after: tuple[str, ...]     # cases whose outcome this one reads (their job runs first, or earlier in its job)
    prepare: Callable | None   # called on this machine right before the case's job starts


class Batch:
    """The cases of one worker script, run as few jobs as their world sizes and dependencies allow."""

    def __init__(self, script: str, tmp_path_factory, whole_file: bool = False, preload: tuple[str, ...] = ()):
        """``whole_file``: the worker does not call workers/cases.py's main itself; each case runs its file.
        ``preload``: modules its ranks' fork server imports beside torch (launcher.rank_python)."""
        self.script, self.tmp, self.whole_file, self.preload = script, tmp_path_factory, whole_file, preload
        self._waiting: dict[str, Case] = {}
        self._outcome: dict[str, str | None] = {}  # name -> None (passed) or what went wrong

    def add(self, name: str, world: int, *argv, after=(), prepare: Callable | None = None) -> None:
        """Case ``name``: the worker's command line ``argv`` on ``world`` ranks, after the cases ``after``
        (``prepare()`` first, on this machine: a failure there is the case's)."""
        assert name not in self._waiting and name not in self._outcome, name
        self._waiting[name] = Case(world, [str(a) for a in argv], tuple(after), prepare)

    def run(self) -> None:
        """Run every case added: one job at a time, each of one world size's cases whose dependencies
        have run (or run before them in the job)."""
        while self._waiting:
            self._job(*self._next_job())

    def check(self, name: str) -> None:
        """Raise the case's own failure, if it had one."""
        outcome = self._outcome[name]
        if outcome is not None:
            raise AssertionError(outcome)

    def _ready(self, world: int) -> list[str]:
        """The waiting cases of ``world`` that can run now, in an order that puts dependencies first."""
        ready: list[str] = []
        for _ in range(len(self._waiting)):
            more = [n for n, c in self._waiting.items() if c.world == world and n not in ready
                    and all(d in self._outcome or d in ready for d in c.after)]
            if not more:
                break
            ready += more
        return ready

    def _next_job(self) -> tuple[int, list[str]]:
        """A world size none of whose cases waits for another job, else the one whose cases let the most
        cases of other world sizes run; and its cases that can run now."""
        def merit(world):
            ready = self._ready(world)
            whole = len(ready) == sum(c.world == world for c in self._waiting.values())
            freed = sum(c.world != world and any(d in ready for d in c.after) for c in self._waiting.values())
            return whole, freed, len(ready), -world
        world = max({c.world for c in self._waiting.values()}, key=merit)
        return world, self._ready(world)

    def _job(self, world: int, names: list[str]) -> None:
        cases = []
        for name in names:
            case = self._waiting.pop(name)
            try:
                if case.prepare is not None:
                    case.prepare()
                cases.append((name, case.argv))
            except Exception:  # noqa: BLE001 - the case's own failure
                self._outcome[name] = f"case {name}: preparing it failed:\n{traceback.format_exc()}"
        if not cases:
            return
        where = self.tmp.mktemp(f"{Path(self.script).stem}-np{world}-cases")
        spec = where / "spec.json"
        spec.write_text(json.dumps({"dir": str(where), "cases": [argv for _, argv in cases]}))
        script = [str(WORKERS / "cases.py")] if self.whole_file else []
        cmd = [*mpiexec(), "-n", str(world), *rank_python(preload=self.preload), "-m", "mpi4py", *script,
               str(WORKERS / self.script), "--cases", str(spec)]
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


def job_output(prefix: Path) -> tuple[str, str]:
    """The stdout and stderr of a case of workers/job_script.py, every rank's, as mpiexec gathers them."""
    return tuple("".join(p.read_text() for p in sorted(prefix.parent.glob(f"{prefix.name}.*.{kind}")))
                 for kind in ("out", "err"))
