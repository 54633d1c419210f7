"""The main job, end to end on 2 real ranks: it trains, logs, and its loss falls.

Its runs are cases of one job per world size (workers/job_script.py, tests/mpi/batch.py), each run's
output kept apart; the run stopped by SIGUSR1 has a job of its own, the signal being mpiexec's."""
from __future__ import annotations

import json

import pytest

from .batch import Batch, job_output, run_planned
from .launcher import rank_python, run_mpi

TINY = ("jobs/train_gpt.py", "--config", "jobs/configs/tiny.toml")


def _tiny(add, where, stage):
    add(2, where / "job", *TINY, "--out", where, "--stage", stage)


def _resumed(add, where):
    add(2, where / "a", *TINY, "--out", where / "a")
    first = add(2, where / "b", *TINY, "--out", where / "b", "--steps", "10", "--save-every", "10")
    add(2, where / "resumed", *TINY, "--out", where / "b", "--resume", after=[first])
    kept = add(2, where / "c", *TINY, "--out", where / "c", "--steps", "12", "--save-every", "4", "--keep-last", "2")
    add(2, where / "from_tag", *TINY, "--out", where / "c", "--resume", "step00000008", after=[kept])


def _reproducible(add, where):
    flags = (*TINY, "--reproducible", "--micro-batches", "6", "--steps", "4")
    add(2, where / "np2", *flags, "--out", where / "np2", "--save-every", "4")
    add(3, where / "np3", *flags, "--out", where / "np3", "--save-every", "4")
    first = add(2, where / "moved", *flags, "--out", where / "moved", "--save-every", "2", "--steps", "2")
    add(3, where / "resumed", *flags, "--out", where / "moved", "--save-every", "4", "--resume", after=[first])


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory):
    return run_planned(request, Batch("job_script.py", tmp_path_factory), {
        "test_train_gpt_tiny": _tiny, "test_train_gpt_resumes_exactly": _resumed,
        "test_train_gpt_reproducible_trains_the_same_model_at_2_and_3_ranks_and_across_a_resume": _reproducible})


@pytest.mark.parametrize("stage", (1, 3))
def test_train_gpt_tiny(ran, request, stage):
    tmp_path = ran(request)
    stdout, stderr = job_output(tmp_path / "job")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 1 and records[-1]["step"] == 20
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
    assert any("val_loss" in r for r in records)
    last = records[-1]
    assert last["model_state_bytes"] > 0
    kinds = set(last["bytes_sent_total"])
    assert {"all_gather", "reduce_scatter"} <= kinds
    assert "done: 20 steps, world size 2, stage %d" % stage in stdout + stderr


def test_train_gpt_resumes_exactly(ran, request):
    """20 steps straight, versus 10 steps + checkpoint + a new job resuming to 20: same loss, bit for bit."""
    tmp_path = ran(request)
    assert "resumed from" in job_output(tmp_path / "resumed")[1]
    a = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert a[-1]["step"] == b[-1]["step"] == 20
    assert a[-1]["loss"] == b[-1]["loss"] and a[-1]["val_loss"] == b[-1]["val_loss"]
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip() == "step00000010"
    # --keep-last 2 left the two newest of steps 4, 8 and 12, and --resume TAG continued from the older one
    # to 20 (saving nothing: tiny.toml's save_every is 0), on the straight run's loss again
    out = job_output(tmp_path / "from_tag")[1]
    assert "resumed from" in out and "step00000008 at step 9" in out, out[-2000:]
    c = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in c] == [1, 5, 10, 12, 10, 15, 20] and c[-1]["loss"] == a[-1]["loss"], (c, a[-1])
    tags = sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir() if p.name.startswith("step"))
    assert tags == ["step00000008", "step00000012"], tags


def test_train_gpt_checkpoints_on_sigusr1_and_the_loss_curve_continues(tmp_path):
    """Slurm's warning signal: checkpoint at the next step boundary, exit 0; the resumed job's
    losses are exactly those of a job that was never interrupted. Every step also starts an
    asynchronous periodic checkpoint, so the signal finds one in flight: it is waited for first."""
    import signal
    import subprocess
    import time

    from .launcher import ROOT, TIMEOUT, mpi_env, mpiexec
    cmd = [*mpiexec(), "-n", "2", *rank_python(fresh=True), "-m", "mpi4py", "jobs/train_gpt.py", "--config",
           "jobs/configs/tiny.toml", "--out", str(tmp_path), "--steps", "150", "--save-every", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it to every rank
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err[-3000:]
    assert "preempted: checkpoint at step" in out
    assert (tmp_path / "checkpoints" / "latest").exists()
    stopped = int(out.split("preempted: checkpoint at step ")[1].split()[0])
    assert stopped < 150
    tiny = ("--config", "jobs/configs/tiny.toml", "--steps", "150")
    run_mpi(2, "jobs/train_gpt.py", *tiny, "--out", str(tmp_path), "--resume")
    run_mpi(2, "jobs/train_gpt.py", *tiny, "--out", str(tmp_path / "straight"))

    def losses(path):
        return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}
    resumed, straight = losses(metrics), losses(tmp_path / "straight" / "metrics.jsonl")
    assert max(resumed) == 150 and any(step > stopped for step in resumed)
    assert all(resumed[step] == straight[step] for step in resumed), (resumed, straight)


def test_train_gpt_reproducible_trains_the_same_model_at_2_and_3_ranks_and_across_a_resume(ran, request):
    """--reproducible: 6 micro-batches per step dealt over 2 or 3 ranks train the same parameters, bit
    for bit; a job saved at 2 ranks and resumed at 3 ends where the uninterrupted one does."""
    import torch

    from zerompi.checkpoint.consolidate import load_full_state_dict

    tmp_path = ran(request)
    assert "resumed from" in job_output(tmp_path / "resumed")[1]
    states = {run: dict(load_full_state_dict(tmp_path / run / "checkpoints")) for run in ("np2", "np3", "moved")}
    assert states["np2"].keys() == states["np3"].keys() == states["moved"].keys()
    for name, ref in states["np2"].items():
        assert torch.equal(states["np3"][name], ref), name
        assert torch.equal(states["moved"][name], ref), name
