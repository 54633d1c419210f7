"""The suite's fork server (tests/mpi/forkserver.py, rank_python.py): a rank whose start would differ from
the server's is declined and runs as the fresh Python it asked for; a served rank gets the signals sent to
the process mpiexec started and ends it as it ended; hash seeds and random generators are each rank's own.

Each test runs the real shim (``python -I -S rank_python.py SOCKETS ARGS``, launcher.rank_python) against
real servers, without mpiexec: with no PMI_RANK the shim is rank 0. A served rank is a child of the server,
so its pid is not the shim's; a declined rank is Python exec'd in the shim's own process. Each docstring
names the break ("Guards: ...") the test was seen to fail with.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import NamedTuple

import pytest

from tests.mpi import launcher
from tests.mpi.rank_python import SENSITIVE

# a server whose imports fixed ATen's capability and seeded numpy's global generator (state_at_import.py)
STATE_AT_IMPORT = ("tests.unit.tools.state_at_import",)
# the classes of SENSITIVE, each tried below: a class added there needs a case here
CLASSES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "ATEN_", "CUDA", "NVIDIA",
           "LD_", "MALLOC_", "GLIBC_", "HDF5_", "NUMPY_", "LC_", "LANG", "TZ", "TMP", "TEMP",
           "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS", "ACCELERATE", "PEFT", "LIGHTNING",
           "PL_", "TQDM")
CAPABILITY = "import torch; print(torch.backends.cpu.get_cpu_capability())"


class Rank(NamedTuple):
    served: bool  # forked by a server (its pid is not the shim's)
    out: list[str]  # what it printed after its pid
    code: int  # the shim's exit status
    err: str


def _shim(preload: tuple[str, ...] = ()) -> list[str]:
    cmd = launcher.rank_python(preload=preload)
    if len(cmd) == 1:
        pytest.skip("no fork server: ZEROMPI_TEST_FORKSERVER=0, or it did not start (servers.log says why)")
    return cmd


@pytest.fixture(scope="module")
def shim() -> list[str]:
    return _shim()


def _env(add: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    return {k: v for k, v in {**launcher.mpi_env(), **(add or {})}.items() if k not in drop}


def _start(shim: list[str], code: str, env: dict[str, str], args: tuple[str, ...] = ()) -> subprocess.Popen:
    """``python ARGS -c CODE`` through ``shim``, the rank printing its pid first."""
    return subprocess.Popen([*shim, *args, "-c", f"import os; print(os.getpid(), flush=True)\n{code}"], env=env,
                            cwd=launcher.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rank(shim: list[str], code: str, add: dict[str, str] | None = None, drop: tuple[str, ...] = (),
         args: tuple[str, ...] = ()) -> Rank:
    """One rank of ``code`` with mpi_env(), ``add`` and without ``drop``, to its end."""
    proc = _start(shim, code, _env(add, drop), args)
    out, err = proc.communicate(timeout=120)
    lines = out.splitlines()
    assert lines, err[-3000:]
    return Rank(int(lines[0]) != proc.pid, lines[1:], proc.returncode, err)


def test_a_rank_that_starts_as_its_server_did_is_forked(shim):
    """The control for every test here that expects a rank declined. Guards: a server that declines every
    rank (each such test would then pass without a server)."""
    assert rank(shim, "").served


def test_every_import_time_class_has_a_case():
    """Guards: a class added to SENSITIVE that no case below tries."""
    assert sorted(SENSITIVE) == sorted(CLASSES)


@pytest.mark.parametrize("prefix", CLASSES)
def test_a_variable_of_each_import_time_class_sends_the_rank_to_python(shim, prefix):
    """A variable of a SENSITIVE class that the server did not start with: the rank is not forked, it
    starts Python. Guards: the class left out of SENSITIVE."""
    got = rank(shim, "", {f"{prefix}ZEROMPI_PROBE": "1"})
    assert not got.served, f"{prefix}ZEROMPI_PROBE=1: forked"


def test_a_rank_without_a_variable_the_server_has_starts_python(shim):
    """mpi_env() gives the server OMP_NUM_THREADS=1; a rank without it uses every core. Guards: comparing
    only the variables the rank has."""
    assert not rank(shim, "", drop=("OMP_NUM_THREADS",)).served


def test_variables_read_later_are_served(shim):
    """CUDA_VISIBLE_DEVICES is read where CUDA starts, which a server never does: a rank choosing its
    device is forked. Guards: READ_LATER emptied (every such rank would start Python)."""
    assert rank(shim, "", {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "") + "7"}).served


def test_another_pythonpath_is_put_in_sys_path(shim, tmp_path):
    """Another PYTHONPATH whose entries hold no module the server imported: forked, and the rank imports
    from it. Guards: a new PYTHONPATH left out of the child's sys.path."""
    (tmp_path / "probe_module.py").write_text("")
    path = os.pathsep.join([str(tmp_path), launcher.mpi_env()["PYTHONPATH"]])
    got = rank(shim, "import probe_module; print(probe_module.__file__)", {"PYTHONPATH": path})
    assert got.out == [str(tmp_path / "probe_module.py")], got.err[-3000:]
    assert got.served


def test_a_pythonpath_that_shadows_an_imported_module_starts_python(shim, tmp_path):
    """A PYTHONPATH entry holding a ``numpy``: a fresh Python imports that one, the server has its own.
    Guards: _path_fits taking any PYTHONPATH."""
    (tmp_path / "numpy.py").write_text("SHADOW = True\n")
    path = os.pathsep.join([str(tmp_path), launcher.mpi_env()["PYTHONPATH"]])
    got = rank(shim, "import numpy; print(getattr(numpy, 'SHADOW', False))", {"PYTHONPATH": path})
    assert got.out == ["True"] and not got.served


def test_an_interpreter_option_starts_python(shim):
    """``python -X dev -c CODE``: an option of the interpreter, which a forked rank could not take.
    Guards: _form reading past the options before ``-c``."""
    got = rank(shim, "import sys; print(sys.flags.dev_mode)", args=("-X", "dev"))
    assert got.out == ["True"] and not got.served


def test_omp_num_threads_takes_effect_in_the_rank(shim):
    """OMP_NUM_THREADS=2 against the server's 1: torch has 2 threads in the rank. Guards: the comparison of
    the import-time environment dropped (a forked rank keeps the server's thread pool of 1)."""
    got = rank(shim, "import torch; print(torch.get_num_threads())", {"OMP_NUM_THREADS": "2"})
    assert got.out == ["2"], got
    assert not got.served


def test_pythonhashseed_takes_effect_in_the_rank(shim):
    """PYTHONHASHSEED=0: the rank hashes as ``python -c`` with it does. Guards: the comparison of the
    import-time environment dropped (a forked rank keeps its server's hash seed)."""
    code = "print(hash('abc'))"
    fresh = subprocess.run([sys.executable, "-c", code], env=_env({"PYTHONHASHSEED": "0"}), capture_output=True,
                           text=True, check=True, timeout=60).stdout.split()
    got = rank(shim, code, {"PYTHONHASHSEED": "0"})
    assert got.out == fresh, got
    assert not got.served


def test_aten_cpu_capability_takes_effect_in_the_rank():
    """A server whose imports ran a kernel has fixed ATen's CPU capability; ATEN_CPU_CAPABILITY=default in
    a rank still gives that rank the default kernels (test_parity_variants' scalar-kernels). Guards: ATEN_
    left out of SENSITIVE."""
    shim = _shim(STATE_AT_IMPORT)
    best = rank(shim, CAPABILITY)
    assert best.served, best.err[-3000:]
    if best.out == ["DEFAULT"]:
        pytest.skip("this CPU has no kernels beyond ATen's default")
    got = rank(shim, CAPABILITY, {"ATEN_CPU_CAPABILITY": "default"})
    assert got.out == ["DEFAULT"], got
    assert not got.served


def _until(proc: subprocess.Popen, line: str) -> int:
    """The rank's pid, once it has printed ``line``."""
    pid = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == line, proc.stderr.read()[-3000:]
    return pid


READY = "import signal, sys\n{handler}\nprint('ready', flush=True)\nwhile True:\n    signal.pause()\n"


def test_sigusr1_sent_to_the_shim_reaches_the_rank(shim):
    """The signal mpiexec passes on (Slurm's warning, a user's kill -USR1) reaches the forked rank's own
    handler. Guards: the shim's forwarding of signals removed."""
    proc = _start(shim, READY.format(handler="signal.signal(signal.SIGUSR1, lambda *_: sys.exit(7))"), _env())
    try:
        assert _until(proc, "ready") != proc.pid
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=60) == 7, proc.stderr.read()[-3000:]
    finally:
        proc.kill()


def test_sigterm_sent_to_the_shim_reaches_the_rank_and_the_shim_ends_by_it(shim):
    """SIGTERM (mpiexec ending a job): the rank's handler runs, the rank ends by SIGTERM and so does the
    shim. Guards: the shim's forwarding of signals removed."""
    handler = ("def term(sig, _frame):\n    print('terminated', flush=True)\n    signal.signal(sig, signal.SIG_DFL)\n"
               "    os.kill(os.getpid(), sig)\nsignal.signal(signal.SIGTERM, term)")
    proc = _start(shim, READY.format(handler=handler), _env())
    try:
        pid = _until(proc, "ready")
        assert pid != proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert proc.stdout.read().split() == ["terminated"]
    finally:
        proc.kill()
    with pytest.raises(ProcessLookupError):  # reaped by its server
        os.kill(pid, 0)


@pytest.mark.parametrize("code,status", [("sys.exit(3)", 3), ("os.kill(os.getpid(), signal.SIGKILL)", -9),
                                         ("os.kill(os.getpid(), signal.SIGUSR2)", -signal.SIGUSR2)],
                         ids=["exit3", "sigkill", "sigusr2"])
def test_the_shim_ends_as_the_rank_did(shim, code, status):
    """mpiexec sees the rank's exit code or signal. Guards: the shim exiting with a status of its own."""
    got = rank(shim, f"import signal, sys\n{code}")
    assert got.served and got.code == status, got


def test_neighbouring_ranks_have_different_hash_seeds(shim):
    """Rank r asks server r mod 2, each with its own hash seed. Guards: one server for every rank."""
    ranks = [rank(shim, "print(hash('abc'))", {"PMI_RANK": str(r)}) for r in (0, 1)]
    assert all(r.served for r in ranks)
    assert ranks[0].out != ranks[1].out


def test_each_served_rank_draws_its_own_random_numbers():
    """Two ranks from a server whose imports drew from numpy's global generator: Python's random (reseeded
    at fork) and numpy's (reseeded in each child) differ. Guards: numpy's reseed in the child removed."""
    shim = _shim(STATE_AT_IMPORT)
    first, second = (rank(shim, "import random, numpy; print(random.random()); print(numpy.random.random())")
                     for _ in range(2))
    assert first.served and second.served
    assert first.out[0] != second.out[0], "Python's random"
    assert first.out[1] != second.out[1], "numpy's global generator"


def test_fresh_ranks_draw_their_own_hash_seeds():
    """rank_python(fresh=True) is the interpreter itself, and the suite sets no PYTHONHASHSEED: each fresh
    rank of each job draws its own seed, as users' ranks do. Guards: fresh=True handing ranks to a server,
    or one PYTHONHASHSEED in mpi_env() for every rank."""
    if "PYTHONHASHSEED" in os.environ:
        pytest.skip("PYTHONHASHSEED is set for this run: every rank has it")
    cmd = launcher.rank_python(fresh=True)
    assert cmd == [sys.executable]
    hashes = {subprocess.run([*cmd, "-c", "print(hash('abc'))"], env=_env(), capture_output=True, text=True,
                             check=True, timeout=60).stdout for _ in range(2)}
    assert len(hashes) == 2
