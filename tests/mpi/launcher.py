"""Start real MPI jobs from pytest: ``mpiexec -n N python -m mpi4py SCRIPT``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"


@lru_cache(maxsize=None)
def mpiexec() -> list[str]:
    """The mpiexec beside this Python (the pip MPI), else ``$ZEROMPI_MPIEXEC`` or PATH's."""
    exe = os.environ.get("ZEROMPI_MPIEXEC") or str(Path(sys.executable).with_name("mpiexec"))
    if not Path(exe).exists():
        exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("no mpiexec found: install the 'mpich' extra or load your site's MPI")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        return [exe, "--oversubscribe"]
    return [exe]


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    # Oversubscribed MPICH ranks busy-poll; yielding early leaves the cores to ranks with work.
    env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "1")
    env.setdefault("MPIR_CVAR_POSIX_POLL_FREQUENCY", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_btl", "self,sm")
    return env


def run_mpi(n: int, script: str, *args: str, timeout: float = 600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``workers/SCRIPT`` (or a repository path like ``jobs/x.py``) on ``n`` ranks, with ``env``
    added to the environment. Raises with the job's output if it fails.
    """
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


def run_worker_json(n: int, script: str, out: Path, *args: str, timeout: float = 600,
                    env: dict[str, str] | None = None) -> dict:
    """Run a worker that writes its results as JSON to ``out`` (rank 0) and load them."""
    run_mpi(n, script, "--out", str(out), *args, timeout=timeout, env=env)
    return json.loads(out.read_text())
