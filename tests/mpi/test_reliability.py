"""No hangs, clear errors: a misbehaving rank ends the job or makes every rank raise (workers/reliability.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from .batch import Batch, run_planned
from .launcher import ROOT, WORKERS, fault_at, mpi_env, mpiexec, rank_python

ABORT_WITHIN = 30.0  # seconds from the failure to every rank gone


def _launch(n, case, out, *, module=True, fresh=False):
    """``fresh``: ranks started as users start them, for a killed or stuck rank (launcher.rank_python)."""
    cmd = [*mpiexec(), "-n", str(n), *rank_python(fresh=fresh), *(("-m", "mpi4py") if module else ()),
           str(WORKERS / "reliability.py"), "--case", case, "--out", str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.parametrize("n", (2, 3))
def test_uncaught_exception_on_one_rank_ends_the_job(tmp_path, n):
    proc = _launch(n, "raise", tmp_path / "x.json", module=False)  # plain python: zerompi's own hook
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - fault_at(err) < ABORT_WITHIN, err[-3000:]
    text = out + err
    assert text.count("failed with an uncaught RuntimeError: boom on purpose") == 1, text[-3000:]
    assert f"rank {n - 1} of {n}" in text


@pytest.mark.parametrize("n,killed", [(3, 1), (2, 0)])
def test_rank_killed_mid_training_ends_the_job_and_is_named_by_rank(tmp_path, n, killed):
    """A rank SIGKILLed mid-training ends the job; its watcher (zerompi/comm/sentinel.py) names it by rank,
    once, and no other rank is named (hydra kills their groups, and so their canaries, before they die). MPICH's
    own message names a process id and host, not always the killed one's.
    Breaks guarded: no watcher started; the watcher silent; a watcher that speaks for a rank killed by the
    launcher's teardown. The race with the teardown itself: tests/unit/comm/test_sentinel.py."""
    proc = _launch(n, "sigkill", tmp_path / "pid", fresh=True)
    pid_file = tmp_path / f"pid.{killed}"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # let it get into training
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < ABORT_WITHIN
    named = re.findall(r"zerompi: rank (\d+) of (\d+) \(pid (\d+) on [^)]+\) ended at .* without a clean exit",
                       out + err)
    assert named == [(str(killed), str(n), str(pid))], (out + err)[-3000:]


def _case(case, world=2, *extra):
    """A case that raises on every rank (or on none): it leaves no rank behind, so several share a job."""
    return lambda add, where, **params: add(params.get("n", world), "--case", case, "--out", where / "r.json", *extra)


@pytest.fixture(scope="module")
def raised(request, tmp_path_factory):
    """The selected tests' mismatch and NaN cases as one reliability.py job per world size (tests/mpi/batch.py)."""
    return run_planned(request, Batch("reliability.py", tmp_path_factory), {
        "test_rank_dependent_control_flow_raises_on_every_rank": _case("mismatch"),
        "test_nan_gradient_raises_on_every_rank_naming_rank_and_parameter": _case("nan"),
        "test_nan_gradient_skip_mode_skips_everywhere": _case("nan", 3, "--nonfinite", "skip")})


def _rows(raised, request) -> list[dict]:
    return json.loads((raised(request) / "r.json").read_text())


def test_rank_dependent_control_flow_raises_on_every_rank(raised, request):
    rows = _rows(raised, request)
    for row in rows:
        assert row["error"].startswith("CollectiveMismatchError: ranks are at different collectives"), row
        assert "rank 0: " in row["error"] and "module 'mid'" in row["error"], row
        assert "rank 1: " in row["error"] and "fc2.weight" in row["error"], row


def test_watchdog_aborts_a_job_stuck_in_a_collective(tmp_path):
    proc = _launch(2, "watchdog", tmp_path / "x.json", fresh=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert time.time() - fault_at(err) < ABORT_WITHIN, err[-3000:]  # the stuck rank would sleep 120 s
    assert "zerompi watchdog: rank 0 of 2 has waited" in err and "collective_timeout=3 s" in err, err[-3000:]


@pytest.mark.parametrize("n", (2, 3))
def test_nan_gradient_raises_on_every_rank_naming_rank_and_parameter(raised, request, n):
    rows = _rows(raised, request)
    for row in rows:
        assert row["error"].startswith("ZeroMPIError: non-finite (NaN/Inf) gradient from rank"), row
        assert f"rank {n - 1}: fc1.bias" in row["error"], row


def test_nan_gradient_skip_mode_skips_everywhere(raised, request):
    rows = _rows(raised, request)
    for row in rows:
        assert row["error"] == "no error" and row["skipped"] == 1, row
        assert row["stepped_at_nan"] is False and row["unchanged"] is True, row
