"""A DeepSpeed training script (workers/ds_script.py) run unchanged but for its import, on 2 ranks.

zerompi must train it (the loss falls), follow the config's WarmupDecayLR step for step, and
write a checkpoint a fresh engine loads. Its per-step losses, and those of real DeepSpeed
running the same script (the test extra's DeepSpeed, gloo on CPU; skipped outside CI without it), are
each judged against a single-process run on the global batch by the parity bound of
tests/mpi/tolerance.py: within ORDER_K times the distance between two summation orders of
that run (whole batch, and the ranks' micro-batches summed), or 16 fp32 ulps of the loss.
Both within that bound of one reference, the two agree with each other as closely as
summation order allows.

workers/ds_surface.py is the other kind of DeepSpeed script: it builds its own FusedAdam,
LambdaLR and dataset and passes them to initialize, asks get_accelerator() for its device and
averages its losses over deepspeed.comm. zerompi must follow the reference within the same
bound and the scheduler's learning rates exactly; DeepSpeed runs FusedAdam as its own CPU
kernel (not torch's AdamW), whose rounding differs, so its losses are held to 1e-5 relative.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from zerompi.compat.deepspeed.schedule import read_schedule
from zerompi.compat.deepspeed.lr_schedules import factor_for

from ..peers import deepspeed_python
from .launcher import ROOT, TIMEOUT, WORKERS, fault_at, mpi_env, mpiexec, rank_python, run_worker_json
from .tolerance import FP32_FLOOR, loss_failures

SCHEDULE = {"scheduler": {"type": "WarmupDecayLR", "params": {
    "total_num_steps": 10, "warmup_num_steps": 2, "warmup_min_lr": 0.002, "warmup_max_lr": 0.02,
    "warmup_type": "linear"}}}  # the script's, for the expected learning rates


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_ref") / "ref.json"
    return run_worker_json(1, "ds_script.py", out, "--impl", "reference", "--world", "2")


@pytest.fixture(scope="module")
def zerompi_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_zerompi")
    return run_worker_json(2, "ds_script.py", tmp / "out.json", "--impl", "zerompi", "--ckpt", str(tmp / "ckpt"))


@pytest.fixture(scope="module")
def surface_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_surface_ref") / "ref.json"
    return run_worker_json(1, "ds_surface.py", out, "--impl", "reference", "--world", "2")


@pytest.fixture(scope="module")
def surface_zerompi(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_surface_zerompi") / "out.json"
    return run_worker_json(2, "ds_surface.py", out, "--impl", "zerompi")


def check_against_reference(run: dict, ref: dict) -> None:
    bad = loss_failures(run["losses"], ref["loss_ref"], ref["loss_alt"], FP32_FLOOR)
    assert not bad, f"{run['impl']}: losses beyond the order-noise bound (step, ours, ref, bound): {bad}"


def test_zerompi_trains_the_script(zerompi_run, reference):
    losses = zerompi_run["losses"]
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3]), losses
    factor = factor_for(read_schedule(SCHEDULE, False), 0.02)
    assert zerompi_run["lrs"] == pytest.approx([factor.value(k) for k in range(10)], rel=1e-12)
    check_against_reference(zerompi_run, reference)


def test_zerompi_checkpoint_loads(zerompi_run):
    r = zerompi_run
    assert r["load_path"].endswith("global_step10") and r["client_state"] == {"step": 10}
    assert r["eval_loaded"] == r["eval_trained"] != r["eval_fresh"]
    assert r["lr_loaded"] == r["lr_trained"]


def test_deepspeed_agrees(zerompi_run, reference, tmp_path):
    python = deepspeed_python()
    out = tmp_path / "out.json"
    cmd = [str(python.with_name("mpiexec")), "-n", "2", str(python), "-m", "mpi4py", str(WORKERS / "ds_script.py"),
           "--impl", "deepspeed", "--out", str(out), "--ckpt", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**mpi_env(), "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    theirs = json.loads(out.read_text())
    check_against_reference(theirs, reference)
    assert theirs["lrs"] == pytest.approx(zerompi_run["lrs"], rel=4 * 2**-52)
    assert theirs["eval_loaded"] == theirs["eval_trained"]  # the same script's checkpoint round trip, under DeepSpeed



def test_zerompi_runs_the_script_that_builds_its_own(surface_zerompi, surface_reference):
    r = surface_zerompi
    assert (r["rank"], r["world"]) == (0, 2)  # deepspeed.comm's answers
    assert len(r["losses"]) == 6 and r["losses"][-1] < 0.2 * r["losses"][0], r["losses"]
    assert r["lrs"] == surface_reference["lrs"]  # the script's LambdaLR, re-pointed at the engine's optimizer
    check_against_reference(r, surface_reference)


def test_the_runner_aliases_deepspeeds_submodules(surface_zerompi, tmp_path):
    """The same script's DeepSpeed branch, unchanged, under ``python -m zerompi.deepspeed``: ``import
    deepspeed``, ``deepspeed.comm``, ``deepspeed.accelerator``, ``deepspeed.ops.adam`` and
    ``deepspeed.utils`` are zerompi's, and it trains the bits the script with zerompi's imports does."""
    out = tmp_path / "out.json"
    env = {**mpi_env(), "PYTHONPATH": os.pathsep.join([str(WORKERS), mpi_env()["PYTHONPATH"]])}
    cmd = [*mpiexec(), "-n", "2", *rank_python(), "-m", "zerompi.deepspeed", str(WORKERS / "ds_surface.py"),
           "--impl", "deepspeed", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    got = json.loads(out.read_text())
    assert all(m.startswith("zerompi.") for m in got["modules"].values()), got["modules"]
    assert got["losses"] == surface_zerompi["losses"] and got["lrs"] == surface_zerompi["lrs"]


def test_the_runner_aborts_on_an_exception_before_initialize(tmp_path):
    """A rank that raises on the script's first lines while its peer waits in a collective ends the job
    within seconds, naming the rank (it used to hang until killed)."""
    script = tmp_path / "early.py"
    script.write_text("import sys, time\nfrom mpi4py import MPI\nimport deepspeed\n"
                      "if MPI.COMM_WORLD.Get_rank() == 1:\n"
                      "    print(f'the fault at {time.time()}', file=sys.stderr, flush=True)\n"
                      "    raise RuntimeError('boom before initialize')\n"
                      "MPI.COMM_WORLD.Barrier()\n")
    proc = subprocess.run([*mpiexec(), "-n", "2", *rank_python(), "-m", "zerompi.deepspeed", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=mpi_env())
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert time.time() - fault_at(proc.stderr) < 30, proc.stderr[-3000:]  # from the raise, not the launch
    assert "rank 1 of 2 failed with an uncaught RuntimeError: boom before initialize" in proc.stderr, proc.stderr[-3000:]


def test_deepspeed_agrees_on_the_script_that_builds_its_own(surface_zerompi, surface_reference, tmp_path):
    python = deepspeed_python()
    out = tmp_path / "out.json"
    cmd = [str(python.with_name("mpiexec")), "-n", "2", str(python), "-m", "mpi4py",
           str(WORKERS / "ds_surface.py"), "--impl", "deepspeed", "--out", str(out)]
    # the first run builds DeepSpeed's CPU ops (FusedAdam, shared-memory comm): minutes on 2 cores
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env={**mpi_env(), "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    theirs = json.loads(out.read_text())
    assert (theirs["rank"], theirs["world"]) == (0, 2)
    assert theirs["lrs"] == pytest.approx(surface_zerompi["lrs"], rel=4 * 2**-52)
    assert theirs["losses"] == pytest.approx(surface_reference["loss_ref"], rel=1e-5)
    assert theirs["losses"] == pytest.approx(surface_zerompi["losses"], rel=1e-5)


def test_gathered_parameters_in_another_order_on_each_rank(tmp_path):
    """zero.GatheredParameters(modifier_rank=0) over the same parameters listed in another order on each
    rank (transformers passes a set): before and after initialize, every rank ends with rank 0's values in
    the right parameters (workers/ds_gather_order.py; a module without reset_parameters included)."""
    got = run_worker_json(2, "ds_gather_order.py", tmp_path / "out.json")
    assert [r["before"] for r in got] == [[1.0, 2.0, 3.0, 4.0, 5.0]] * 2
    assert [r["after"] for r in got] == [[10.0, 20.0, 30.0, 40.0, 50.0]] * 2
