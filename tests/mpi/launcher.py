"""Start real MPI jobs from pytest: ``mpiexec -n N python -m mpi4py SCRIPT``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from zerompi.tools.mpirun import mpi_env as _mpi_env
from zerompi.tools.mpirun import mpiexec

__all__ = ["ROOT", "WORKERS", "mpi_env", "mpiexec", "run_mpi"]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"


def mpi_env() -> dict[str, str]:
    return _mpi_env(ROOT)


TIMEOUT = float(os.environ.get("ZEROMPI_TEST_TIMEOUT", 600))  # seconds per job; more on a crowded machine


def run_mpi(n: int, script: str, *args: str, timeout: float | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``workers/SCRIPT`` (or a repository path like ``jobs/x.py``) on ``n`` ranks, with ``env``
    added to the environment. Raises with the job's output if it fails or runs past ``timeout`` seconds
    (default ``$ZEROMPI_TEST_TIMEOUT``, else 600).
    """
    timeout = TIMEOUT if timeout is None else timeout
    path = ROOT / script if "/" in script else WORKERS / script
    cmd = [*mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", str(path), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**mpi_env(), **(env or {})},
                          cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


class WorkerResults:
    """Runs a JSON-writing worker once per world size and indexes its rows by ``key(row)``.

    Many parametrised tests judge the rows of one ``mpiexec`` run; this keeps
    that run to one per world size and module.
    """

    def __init__(self, script: str, key, tmp_path_factory):
        self.script, self.key, self.tmp = script, key, tmp_path_factory
        self._rows: dict[tuple, dict] = {}

    def __call__(self, world: int, *args: str) -> dict:
        if (world, *args) not in self._rows:
            out = self.tmp.mktemp(f"{Path(self.script).stem}{world}") / "results.json"
            rows = run_worker_json(world, self.script, out, *args)
            self._rows[(world, *args)] = {self.key(r): r for r in rows}
        return self._rows[(world, *args)]


def run_worker_json(n: int, script: str, out: Path, *args: str, timeout: float | None = None,
                    env: dict[str, str] | None = None) -> dict:
    """Run a worker that writes its results as JSON to ``out`` (rank 0) and load them."""
    run_mpi(n, script, "--out", str(out), *args, timeout=timeout, env=env)
    return json.loads(out.read_text())
