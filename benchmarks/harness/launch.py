"""One ``mpiexec`` job with a timeout, in its own process group.

A job that fails or runs past its timeout is an :class:`Outcome` with status ``failed`` or ``timeout``
and the tail of its output, so that a run of many rows records it and goes on; ``Outcome.check()``
raises for the benchmarks whose later rows need this one.
"""
from __future__ import annotations

import enum
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .paths import ROOT
from .stamp import loadavg

# MPICH ranks that yield the core while they wait: oversubscribed ranks otherwise busy-poll.
MPICH_YIELD = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_POSIX_POLL_FREQUENCY": "1"}
KILL_GRACE_S = 10.0  # after SIGTERM, before SIGKILL: long enough for mpiexec to take its ranks down


class Status(str, enum.Enum):
    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"


@dataclass
class Outcome:
    status: Status
    output: str          # stdout and stderr, interleaved
    code: int | None     # exit code (negative: the signal that ended it)
    wall_s: float
    timeout: float | None
    loadavg_before: list[float]
    loadavg_after: list[float]

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def error(self, lines: int = 6) -> str:
        """Why it is not ok, then the end of its output (warnings left out)."""
        why = f"timed out after {self.timeout:.0f} s" if self.status is Status.TIMEOUT else f"exit code {self.code}"
        return f"{why}\n{tail(self.output, lines)}"

    def record(self) -> dict:
        """The fields a row takes from its job."""
        row = dict(status=self.status.value, wall_s=self.wall_s, loadavg_before=self.loadavg_before,
                   loadavg_after=self.loadavg_after)
        return row if self.ok else dict(row, error=self.error())

    def check(self) -> Outcome:
        if not self.ok:
            raise RuntimeError(f"job {self.status.value}: {self.error(lines=40)}")
        return self


def tail(text: str, lines: int = 6) -> str:
    noise = ("Warning", "warnings.warn", "return func(", "built successfully")
    keep = [ln for ln in text.splitlines() if ln.strip() and not any(n in ln for n in noise)]
    return "\n".join(keep[-lines:])[-1500:]


def find_mpiexec(explicit: str | None = None) -> str:
    """``explicit``, else the mpiexec beside this Python, else ``$ZEROMPI_MPIEXEC``, else PATH's."""
    for cand in (explicit, str(Path(sys.executable).parent / "mpiexec"), os.environ.get("ZEROMPI_MPIEXEC"),
                 shutil.which("mpiexec")):
        if cand and Path(cand).exists():
            return cand
    raise SystemExit("no mpiexec found: run benchmarks/setup_peers.sh or pass --mpiexec")


def mpi_command(n: int, script: Path | str, *args, mpiexec: str | list[str] | None = None,
                prefix: tuple[str, ...] = (), python: Path | str = sys.executable, abort_on_error: bool = True
                ) -> list[str]:
    """``mpiexec -n N [prefix] python -m mpi4py SCRIPT ARGS``: ``mpiexec`` a path or a launcher with its options
    (default zerompi.tools.mpirun's, which gives Open MPI ``--oversubscribe``); ``prefix`` e.g. a profiler each
    rank runs under; ``python`` another venv's. ``abort_on_error=False`` runs ``python SCRIPT``: a rank's
    uncaught exception then does not abort the job (mpi4py's ``-m`` would), which fault-tolerance jobs need."""
    from zerompi.tools.mpirun import mpiexec as default
    launcher = default() if mpiexec is None else [mpiexec] if isinstance(mpiexec, str) else list(mpiexec)
    runner = ["-m", "mpi4py"] if abort_on_error else []
    return [*launcher, "-n", str(n), *prefix, str(python), *runner, str(script), *map(str, args)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(mpich_yield: bool, rendezvous: bool = False, extra: dict | tuple = (), one_thread: bool = True) -> dict:
    """The environment of one job: the checkout on PYTHONPATH, unbuffered output;
    ``mpich_yield``: waiting ranks yield the core (unless this environment says otherwise);
    ``rendezvous``: torch.distributed's at 127.0.0.1 on a free port;
    ``one_thread``: one OpenMP/MKL thread per rank (ranks share the cores)."""
    from zerompi.tools.mpirun import mpi_env
    env = mpi_env(ROOT)
    if os.environ.get("PYTHONPATH"):  # a caller's own tree goes first (ab_commits.py measures another tree)
        env["PYTHONPATH"] = os.pathsep.join([os.environ["PYTHONPATH"], str(ROOT)])
    if not mpich_yield:  # mpi_env turns yielding on; a benchmark may measure without it
        for key in MPICH_YIELD:
            if key not in os.environ:
                env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    if one_thread:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    elif "OMP_NUM_THREADS" not in os.environ:
        env.pop("OMP_NUM_THREADS", None)
    if rendezvous:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(dict(extra))
    return env


def run(cmd: list[str], env: dict | None = None, timeout: float | None = 1800.0, cwd: Path = ROOT) -> Outcome:
    """Run one job to its end or its timeout: then SIGTERM, and SIGKILL after a grace, to its whole
    process group (mpiexec and its ranks)."""
    before, t0 = loadavg(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env if env is not None else job_env(mpich_yield=True),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        status = Status.OK if proc.returncode == 0 else Status.FAILED
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        status = Status.TIMEOUT
    return Outcome(status, output or "", proc.returncode, time.perf_counter() - t0, timeout, before, loadavg())


def run_json(cmd: list[str], out: Path, env: dict | None = None, timeout: float = 1800.0,
             cwd: Path = ROOT) -> tuple[Outcome, object | None]:
    """Run a worker that writes its result as JSON to ``out``: the outcome and the result (None unless ok;
    a job that exits 0 without a readable result is ``failed``)."""
    outcome = run(cmd, env, timeout, cwd)
    if not outcome.ok:
        return outcome, None
    try:
        return outcome, json.loads(Path(out).read_text())
    except (OSError, ValueError) as e:
        outcome.status, outcome.output = Status.FAILED, f"{outcome.output}\nno result file: {e}"
        return outcome, None
