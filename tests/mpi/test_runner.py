"""``python -m zerompi.deepspeed`` as users start it: what the script sees (the alias, its argv and
sys.path, ``-m`` module mode, ``--local_rank_arg``), a missing script, and an exception on one rank
that ends the job instead of hanging it. Ranks are fresh processes (not forked from the test's server):
the runner is a process's start, and one case is a rank's death."""
from __future__ import annotations

import json
import os
import subprocess

from .launcher import ROOT, TIMEOUT, WORKERS, mpi_env, mpiexec, rank_python

WORKER = WORKERS / "runner_argv.py"
PACKAGE = "zerompi.compat.deepspeed"


def _run(tmp_path, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = mpi_env()
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)  # -m runner_argv
    cmd = [*mpiexec(), "-n", "2", *rank_python(fresh=True), "-m", "zerompi.deepspeed", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _rows(out) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_script_runs_as_main_with_deepspeed_aliased_and_its_own_argv(tmp_path):
    """Breaks caught: the alias not installed, --local_rank not appended, sys.path[0] not the script's
    folder, Accelerate's backend not prepared."""
    proc = _run(tmp_path, "--local_rank_arg", str(WORKER), str(tmp_path), "--lr", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r, row in enumerate(_rows(tmp_path)):
        assert row == {"deepspeed": PACKAGE, "argv": [str(WORKER), str(tmp_path), "--lr", "1", f"--local_rank={r}"],
                       "path0": str(WORKERS), "name": "__main__", "accelerate": True}, row


def test_a_module_runs_with_dash_m_as_python_m_would(tmp_path):
    """``-m runner_argv``: argv[0] is the module's file (runpy's alter_sys), the runner's own options are
    gone from argv, and no --local_rank without --local_rank_arg. Breaks caught: argv not replaced,
    alter_sys dropped, the module run and then the script path tried as well."""
    proc = _run(tmp_path, "-m", "runner_argv", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in _rows(tmp_path):
        assert row["deepspeed"] == PACKAGE and row["name"] == "__main__", row
        assert row["argv"] == [str(WORKER), str(tmp_path)], row


def test_a_missing_script_is_named(tmp_path):
    proc = _run(tmp_path, str(tmp_path / "no_such_train.py"))
    assert proc.returncode != 0
    assert f"python -m zerompi.deepspeed: no such script: {tmp_path / 'no_such_train.py'}" in proc.stderr


def test_an_exception_on_one_rank_ends_the_job_naming_the_rank(tmp_path):
    """Rank 1 raises at the script's start while rank 0 waits in a barrier: the runner's hook aborts the job
    (nonzero, within the timeout) and names rank 1. Break caught: the hook not installed (the job hangs)."""
    try:
        proc = _run(tmp_path, str(WORKER), str(tmp_path), "raise-on-1", timeout=120)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("the job hung after rank 1 raised: the runner did not abort it") from e
    assert proc.returncode != 0
    assert "zerompi: rank 1 of 2 failed with an uncaught RuntimeError: the script failed on rank 1" in proc.stderr, \
        proc.stderr[-4000:]
