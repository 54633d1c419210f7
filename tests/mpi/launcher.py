"""Start real MPI jobs from pytest: ``mpiexec -n N python -m mpi4py SCRIPT``."""
from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zerompi.tools.mpirun import mpi_env as _mpi_env
from zerompi.tools.mpirun import mpiexec

from .rank_python import READ_LATER, SENSITIVE

__all__ = ["HF_STACK", "ROOT", "WORKERS", "mpi_env", "mpiexec", "plain_env", "rank_python", "run_mpi"]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"


# The variables read at import as the session began (tests/conftest.py imports this module first): what
# an in-process test's imports set later (DeepSpeed's and Lightning's PYTORCH_NVML_BASED_CUDA_CHECK,
# inductor's cache directory) stays out of every later job, whose ranks then match the fork servers.
_AT_IMPORT = {k: v for k, v in _mpi_env(ROOT).items() if k.startswith(SENSITIVE)}


def mpi_env() -> dict[str, str]:
    """zerompi.tools.mpirun's environment for ranks, with the variables read at import as the session began."""
    return {**{k: v for k, v in _mpi_env(ROOT).items() if not k.startswith(SENSITIVE)}, **_AT_IMPORT}


# what a torch-style launcher sets for each process (an in-process test may have set them in pytest's)
LAUNCHER = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def plain_env() -> dict[str, str]:
    """mpi_env() for one plain process, the single-process reference of a framework: none of LAUNCHER."""
    return {k: v for k, v in mpi_env().items() if k not in LAUNCHER}


# What transformers' Trainer imports beyond torch that never looks for deepspeed (about 1.5 of its 2.5 CPU
# s a rank): a server with these preloaded serves `-m zerompi.deepspeed` jobs too, whose runner must alias
# deepspeed before transformers, accelerate or peft (none of them preloaded) look for it.
HF_STACK = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.export", "sympy",
            "scipy.linalg", "scipy.special", "pyarrow", "pandas", "regex", "tokenizers", "PIL.Image", "datasets")
SERVERS = 2  # fork servers per interpreter (tests/mpi/forkserver.py): rank r asks server r mod SERVERS
_servers: dict[tuple, list[str]] = {}
_servers_lock = threading.Lock()


# Fresh ranks, rank_python(fresh=True): mpiexec starts ``python`` itself on each rank, as users run it. The
# tests of a rank's death, a signal or a hang need them (test_hang, test_ulfm, the kill and watchdog cases of
# test_reliability, test_checkpoint's kills, test_job's SIGUSR1; test_slurm's jobs start Python through
# jobs/slurm/train.sbatch): from a fork server, the process mpiexec watches is the shim, not the rank. A killed
# rank reaches mpiexec only once the server has reaped it and the shim has re-raised its signal; a stopped
# rank leaves the shim running, and a SIGSTOP sent to the shim stops only the shim (it cannot be caught, so
# it is not forwarded); a signal from mpiexec arrives through the shim's handler. Those tests must see what
# users run; each of their ranks pays Python's start and the torch import (about 1.3 CPU s).
#
# Hash seeds. A fresh rank draws its own str/bytes hash seed at start (the suite leaves PYTHONHASHSEED unset,
# as users' ranks have it): one per rank and per job. A forked rank has its server's, drawn when the server
# started (hash randomization is fixed at interpreter start and cannot be redrawn in a child): one per server
# for the whole run, rank r asking server r mod SERVERS, so neighbouring ranks still differ. Per forked rank:
# Python's ``random`` (reseeded at fork) and numpy's global generator (reseeded from the OS); torch's default
# generator has its fixed default seed, as in a fresh Python.
def rank_python(python: str | os.PathLike | None = None, preload: tuple[str, ...] = (),
                env: dict[str, str] | None = None, launcher: str | os.PathLike | None = None,
                *, fresh: bool = False) -> list[str]:
    """What mpiexec starts on each rank in place of ``python`` (default: this one): rank_python.py handing
    the rank to a fork server of that interpreter with torch (and the modules ``preload``) imported
    (tests/mpi/forkserver.py), or ``python`` itself where ``fresh`` (see above: tests of death, signals and
    hangs), ``ZEROMPI_TEST_FORKSERVER=0`` or no server started.
    ``preload``: modules beyond those ("-h5py" leaves h5py out); ``env``: the variables the job's ranks get
    beyond mpi_env() (those read at import start the server with them); ``launcher``: the mpiexec that
    starts the ranks, where it is not ``python``'s sibling."""
    if fresh:
        return [str(python or sys.executable)]
    at_import = tuple(sorted((k, v) for k, v in (env or {}).items()  # a server swaps PYTHONPATH in itself
                             if k.startswith(SENSITIVE) and k not in ("PYTHONPATH", *READ_LATER)))
    key = (str(python or sys.executable), tuple(preload), at_import, str(launcher or ""))
    with _servers_lock:
        if key not in _servers:
            on = os.environ.get("ZEROMPI_TEST_FORKSERVER", "1") != "0"
            _servers[key] = _start_servers(*key) if on else []
    if not _servers[key]:
        return [key[0]]
    return [key[0], "-I", "-S", str(Path(__file__).with_name("rank_python.py")), ",".join(_servers[key])]


def _rank_env(python: str, at_import: tuple[tuple[str, str], ...], launcher: str) -> dict[str, str]:
    """mpi_env() and ``at_import`` as a rank of ``launcher`` (default: ``python``'s sibling mpiexec) sees
    them: Open MPI adds LD_LIBRARY_PATH and PYTHONUNBUFFERED, which a server must have to serve its ranks
    (rank_python.SENSITIVE)."""
    env = {**mpi_env(), **dict(at_import)}
    mpiexec_ = Path(launcher) if launcher else Path(python).with_name("mpiexec")
    if mpiexec_.exists():
        show = "import json, os; print(json.dumps(dict(os.environ)))"
        proc = subprocess.run([str(mpiexec_), "-n", "1", python, "-I", "-S", "-c", show], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            seen = json.loads(proc.stdout.strip().splitlines()[-1])
            env.update((k, v) for k, v in seen.items() if k.startswith(SENSITIVE) and k not in env)
    return env


def _start_servers(python: str, preload: tuple[str, ...], at_import: tuple[tuple[str, str], ...],
                   launcher: str) -> list[str]:
    where = Path(tempfile.mkdtemp(prefix="zerompi-fork-"))
    paths = [str(where / f"{i}.sock") for i in range(SERVERS)]
    env = _rank_env(python, at_import, launcher)
    server = [python, str(Path(__file__).with_name("forkserver.py"))]
    with open(where / "servers.log", "ab") as log:
        procs = [subprocess.Popen([*server, path, ",".join(preload)], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=log) for path in paths]

    def stop() -> None:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        shutil.rmtree(where, ignore_errors=True)
    atexit.register(stop)
    end = time.monotonic() + 120
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > end or any(p.poll() is not None for p in procs):
            return []  # every rank starts Python instead; servers.log says why
        time.sleep(0.02)
    return paths


def fault_at(stderr: str) -> float:
    """When a job's rank misbehaved on purpose (the line workers/common.py's ``say_fault`` prints): where a
    test's bound on the job's end starts."""
    found = re.search(r"the fault at ([0-9.]+)", stderr)
    assert found, f"no fault time in the job's stderr:\n{stderr[-3000:]}"
    return float(found.group(1))


TIMEOUT = float(os.environ.get("ZEROMPI_TEST_TIMEOUT", 600))  # seconds per job; more on a crowded machine


def run_mpi(n: int, script: str, *args: str, timeout: float | None = None,
            env: dict[str, str] | None = None, preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``workers/SCRIPT`` (or a repository path like ``jobs/x.py``) on ``n`` ranks, with ``env``
    added to the environment. Raises with the job's output if it fails or runs past ``timeout`` seconds
    (default ``$ZEROMPI_TEST_TIMEOUT``, else 600; ``preload``: rank_python's).
    """
    timeout = TIMEOUT if timeout is None else timeout
    path = ROOT / script if "/" in script else WORKERS / script
    cmd = [*mpiexec(), "-n", str(n), *rank_python(preload=preload), "-m", "mpi4py", str(path), *args]
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

    def __init__(self, script: str, key, tmp_path_factory, preload: tuple[str, ...] = ()):
        self.script, self.key, self.tmp, self.preload = script, key, tmp_path_factory, preload
        self._rows: dict[tuple, dict] = {}

    def __call__(self, world: int, *args: str) -> dict:
        if (world, *args) not in self._rows:
            out = self.tmp.mktemp(f"{Path(self.script).stem}{world}") / "results.json"
            rows = run_worker_json(world, self.script, out, *args, preload=self.preload)
            self._rows[(world, *args)] = {self.key(r): r for r in rows}
        return self._rows[(world, *args)]


def run_worker_json(n: int, script: str, out: Path, *args: str, timeout: float | None = None,
                    env: dict[str, str] | None = None, preload: tuple[str, ...] = ()) -> dict:
    """Run a worker that writes its results as JSON to ``out`` (rank 0) and load them."""
    run_mpi(n, script, "--out", str(out), *args, timeout=timeout, env=env, preload=preload)
    return json.loads(out.read_text())


def run_in_turn(script: Path, runs: list[list[str]], where: Path, env: dict[str, str],
                preload: tuple[str, ...] = HF_STACK, timeout: float | None = None) -> None:
    """``python SCRIPT ARGS`` for each ARGS of ``runs``, one after another in one plain process
    (workers/in_turn.py): a module's single-process references with one interpreter start and one import."""
    listed = where / f"{Path(script).stem}-runs.json"
    listed.write_text(json.dumps(runs))
    proc = subprocess.run([*rank_python(preload=preload, env=env), str(WORKERS / "in_turn.py"), str(script),
                           str(listed)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT if timeout is None else timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} in turn over {runs} exited {proc.returncode}\n{proc.stderr[-8000:]}")
