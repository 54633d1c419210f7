"""fault_tolerance=True under Open MPI with ULFM: ranks SIGKILLed mid-training, the survivors finish.

Each case starts 4 ranks (3, 5 and 6 in three more) under ``mpiexec --with-ft ulfm`` (the `.venv-openmpi` of test_openmpi.py),
kills one or two of them in forward, backward (or before end_backward), the optimizer step, while a
recovery point is taken, in a synchronous or asynchronous checkpoint save (rank 0 among them), or before
full_state_dict, and checks that training
finishes on the survivors with the SHA-256 of the parameters, fp32 masters and optimizer state equal
to the failure-free run's (reproducible=True, G = 6, run at 3 ranks without fault tolerance), and that
each recovery was reported. Stage 3 is covered case by case, stages 1 and 2 with one case each, CPU
offload with one, Muon's and Adafactor's whole-tensor groups with three; recovery points in memory (the default) and on disk. Without reproducible=True the
recovered state is judged within summation-order noise instead.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from .launcher import ROOT, WORKERS, fault_at, mpi_env, rank_python
from .openmpi_venv import openmpi_venv
from .tolerance import tensor_failures

# The default suite runs the cases marked True (a kill in the step, in a save, of rank 0, of two ranks at once,
# with a fixed collective_timeout, at stage 3, and one at stage 1); ZEROMPI_ULFM_TESTS=1 runs every case. A job used to hang at its exit after a
# recovery now and then (MPI_Finalize's fence waited for the lost rank): --mca async_mpi_finalize 1 ends that.
EVERY_CASE = os.environ.get("ZEROMPI_ULFM_TESTS") == "1"
TIMEOUT = float(os.environ.get("ZEROMPI_TEST_TIMEOUT", 150))  # a job takes about 6 s
FLAGS = ("--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1")
BTL = os.environ.get("ZEROMPI_ULFM_BTL", "self,sm")  # shared memory, as one node gets; "tcp,self" passes too


@pytest.fixture(scope="module")
def openmpi():
    return openmpi_venv("Open MPI with ULFM", ", --with-ft ulfm")


def job(venv, tmp_path, n: int, *args: str, launch=FLAGS,
        timeout: float = TIMEOUT) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / f"ulfm-{n}-{abs(hash(args))}.json"
    # fresh ranks: what Open MPI sees die is the rank itself, as in users' jobs (launcher.rank_python)
    cmd = [str(venv / "bin" / "mpiexec"), *launch, "--mca", "btl", BTL, "--oversubscribe", "-n", str(n),
           *rank_python(venv / "bin" / "python", fresh=True), "-m", "mpi4py", str(WORKERS / "ulfm.py"), "--out", str(out),
           *args]
    for _ in range(3):  # Open MPI's launcher now and then fails to start its PMIx server before any rank runs
        proc = _run(cmd, timeout)
        if "PMIx server's listener thread failed to start" not in proc.stderr:
            break
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a job; one past ``timeout`` s fails the test with every rank's Python stacks (SIGUSR2, which mpiexec
    forwards to the ranks: the worker's faulthandler prints them) and what the job printed."""
    with subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.send_signal(signal.SIGUSR2)
            time.sleep(3)
            os.killpg(job.pid, signal.SIGKILL)
            try:
                out, err = job.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a process outside the session holds the pipes: no output
                out, err = "", "(the job's output did not end within 30 s of its kill)"
            raise AssertionError(f"the job ran past {timeout:g} s: {' '.join(cmd)}\n--- stdout\n{out[-3000:]}\n"
                                 f"--- stderr (with each rank's stacks at the end)\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(cmd, job.returncode, out, err)


TRAINING_ARGS = ("--muon", "--adafactor")  # worker arguments that change what is trained (the rest change how it survives)


def key(stage: int, extra: tuple[str, ...] = ()) -> tuple:
    """What a case trains: its stage and the arguments among TRAINING_ARGS."""
    return (stage, *(a for a in extra if a in TRAINING_ARGS))


CASES = {  # id: (stage, kills RANK:PHASE:STEP, extra worker args, ranks left, in the default suite)
    "forward": (3, "1:forward:2", (), 3, False),
    "backward": (3, "2:backward:1", (), 3, False),
    "step": (3, "1:step:2", (), 3, True),
    "save": (3, "3:save:1", (), 3, True),  # in its shard file's write of the checkpoint saved after step 2
    "recovery-save": (3, "2:recovery_save:1", (), 3, False),  # writing the recovery checkpoint after step 2
    "rank0": (3, "0:step:1", (), 3, True),
    "two-at-once": (3, "1:backward:1,2:backward:1", (), 2, True),
    "one-then-another": (3, "2:forward:1,0:step:3", (), 2, False),
    "replay": (3, "1:step:2", ("--recovery-every", "3"), 3, False),  # recovers from step 0, replays two steps
    "stage1": (1, "2:backward:1", (), 3, True),
    "stage2": (2, "1:step:2", (), 3, False),
    # verbs recovery wraps by construction: the survivors notice in end_backward's reduction of the
    # round (stage 2: nothing is gathered in backward) and in full_state_dict's gathers
    "end-backward": (2, "1:end_backward:1", ("--halves",), 3, True),
    "full-state-dict": (3, "2:full_state_dict:1", ("--consolidate",), 3, True),
    # the survivors' watchdog restarts with the job's fixed deadline (a float once crashed the rebuild)
    "collective-timeout": (3, "2:step:1", ("--collective-timeout", "120"), 3, True),
    "offload-cpu": (3, "1:step:2", ("--offload", "cpu"), 3, True),  # points taken from host-memory shards
    "async-save": (3, "2:async_save:1", ("--async-save",), 3, True),  # in the save's background write
    # recovery_source='disk': recovery checkpoints as files
    "disk-step": (3, "1:step:2", ("--source", "disk"), 3, True),
    "disk-two-at-once": (3, "1:backward:1,3:backward:1", ("--source", "disk"), 2, False),
    "disk-recovery-save": (3, "2:recovery_save:1", ("--source", "disk"), 3, False),
    # Muon on the matrices: whole tensors on owner ranks, whose owners change with the world size
    "muon-stage3": (3, "1:step:2", ("--muon",), 3, True),
    "muon-stage2-rank0": (2, "0:backward:1", ("--muon",), 3, True),
    "adafactor-stage3": (3, "2:step:2", ("--adafactor",), 3, True),  # factored state, whole per tensor
}

NOTICED_IN = {"end-backward": "end_backward", "full-state-dict": "full_state_dict"}
RUN = [case for case, (*_, default) in CASES.items() if default or EVERY_CASE]

WITHOUT_REPRODUCIBLE = {  # id: (kills, extra worker args, the failure-free runs (ranks, args); the first is the reference)
    "flat": ("1:step:2", (), [(4, ()), (3, ()), (2, ())]),
    # hsdp over two emulated nodes of two ranks; one node lost: its two ranks at once
    "hsdp-node": ("2:step:2,3:step:2", ("--hsdp",), [(4, ("--hsdp",)), (2, ("--hsdp",)), (3, ())]),
}
SUMMED = ("--stage", "3", "--reproducible", "off")


@pytest.fixture(scope="module")
def failure_free(openmpi, tmp_path_factory) -> dict:
    """Every failure-free run the module judges by, one after another in one job of 4 ranks (each on the
    first N, without fault tolerance): per key() the digest at 3 ranks (reproducible: the same at any world
    size), and per WITHOUT_REPRODUCIBLE run (N, args) its state."""
    keys = sorted({key(stage, extra) for stage, _, extra, _, _ in (CASES[c] for c in RUN)} | {key(3)})
    summed = sorted({(n, args) for _, _, runs in WITHOUT_REPRODUCIBLE.values() for n, args in runs})
    runs = [(3, ["--stage", *map(str, k)]) for k in keys] + [(n, [*SUMMED, *args]) for n, args in summed]
    # one job trains every run in turn: TIMEOUT (one case's job, which trains once) for each
    proc, result = job(openmpi, tmp_path_factory.mktemp("failure-free"), 4, "--failure-free", json.dumps(runs),
                       launch=(), timeout=TIMEOUT * len(runs))
    assert result is not None, proc.stderr[-6000:]
    done = dict(zip([*keys, *summed], result["runs"]))
    return {k: v["digest"] if k in keys else v for k, v in done.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_survives_lost_ranks(openmpi, failure_free, tmp_path, case):
    stage, kills, extra, left, default = CASES[case]
    if not (default or EVERY_CASE):
        pytest.skip("one of the longer list of kills: ZEROMPI_ULFM_TESTS=1 runs it")
    proc, result = job(openmpi, tmp_path, 4, "--stage", str(stage), "--kill", kills, *extra)
    assert result is not None, proc.stderr[-8000:]
    assert result["world"] == left and result["steps"] == 4
    assert result["digest"] == failure_free[key(stage, extra)], "the trained bits differ from the failure-free run"
    lost = sorted(r for report in result["reports"] for r in report["lost_world"])
    assert lost == sorted(int(k.split(":")[0]) for k in kills.split(",")), result["reports"]
    for report in result["reports"]:
        assert report["seconds"] < 30 and report["resumed_at"] <= report["at_step"], report
    assert "fault_tolerance: lost rank(s)" in proc.stderr, proc.stderr[-4000:]
    if case in NOTICED_IN:  # the verb the survivors noticed the loss in
        assert [r["during"] for r in result["reports"]] == [NOTICED_IN[case]], result["reports"]
    if case == "replay":
        assert [r["resumed_at"] for r in result["reports"]] == [0]


@pytest.mark.parametrize("n,kills", [(3, "1:step:2"), (5, "3:backward:1"), (6, "4:step:2")])
def test_survives_at_uneven_world_sizes(openmpi, failure_free, tmp_path, n, kills):
    """Where the buddy (N // 2 places on) is not the same in both directions, as it is at 4 ranks: the
    lost rank's state comes from the right copy, and a wrong one ends the job at once, named
    (recovery/sources.py's coverage check), instead of a load waiting for a missing file."""
    proc, result = job(openmpi, tmp_path, n, "--stage", "3", "--kill", kills)
    assert result is not None, proc.stderr[-8000:]
    assert result["world"] == n - 1 and result["steps"] == 4
    assert result["digest"] == failure_free[key(3)], "the trained bits differ from the failure-free run"


def test_a_recovery_that_fails_ends_the_job_naming_why(openmpi, tmp_path):
    """The recovery points deleted under the job: the survivors' reload fails, and that error ends the
    job within seconds instead of being taken for another lost rank (its context is the first loss)."""
    proc, result = job(openmpi, tmp_path, 3, "--source", "disk", "--kill", "1:step:2", "--remove-points")
    ended = time.time()
    assert result is None and proc.returncode != 0
    # from the points' removal (the worker's fault line): not a watchdog's or the test's timeout
    assert ended - fault_at(proc.stderr) < 60, proc.stderr[-4000:]
    assert "recovering again" not in proc.stderr, proc.stderr[-4000:]
    assert "CheckpointError" in proc.stderr and "step00000002" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("case", list(WITHOUT_REPRODUCIBLE))
def test_survives_without_reproducible_within_order_noise(openmpi, failure_free, tmp_path, case):
    """reproducible=False (micro_batches alone): the survivors train the same micro-batches, summed in
    MPI's order. The recovered state may differ from the failure-free run's by summation order alone:
    per tensor within ORDER_K times what the failure-free run moves at other world sizes (and layouts)."""
    kills, extra, references = WITHOUT_REPRODUCIBLE[case]
    runs = [failure_free[(n, args)] for n, args in references]
    proc, got = job(openmpi, tmp_path, 4, *SUMMED, *extra, "--kill", kills)
    assert got is not None, proc.stderr[-8000:]
    assert got["world"] == 4 - len(kills.split(",")) and got["steps"] == 4 and len(got["reports"]) == 1, got
    ref = {k: np.asarray(v) for k, v in runs[0]["state"].items()}

    def distance(state):
        return {k: float(np.abs(np.asarray(state[k]) - r).max() / max(np.abs(r).max(), 1e-30)) for k, r in ref.items()}
    noise = {k: max(distance(result["state"])[k] for result in runs[1:]) for k in ref}
    assert max(noise.values()) > 0, "the world sizes summed alike: no order noise to judge by"
    assert not tensor_failures(distance(got["state"]), noise)


def test_memory_points_abort_when_a_rank_and_its_buddy_are_lost(openmpi, tmp_path):
    """At 4 ranks ranks 1 and 3 hold each other's recovery point: losing both ends the job, naming them."""
    proc, result = job(openmpi, tmp_path, 4, "--kill", "1:backward:1,3:backward:1")
    assert result is None and proc.returncode != 0
    assert "rank(s) 1 (whose copy rank 3 held), 3 (whose copy rank 1 held) were lost together" in proc.stderr, \
        proc.stderr[-4000:]


def test_too_few_survivors_abort(openmpi, tmp_path):
    proc, result = job(openmpi, tmp_path, 3, "--kill", "1:step:1", "--min-ranks", "3")
    assert result is None and proc.returncode != 0
    assert "fewer than min_ranks=3: giving up" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("launch,missing", [((), "--with-ft ulfm"), (FLAGS[:2], "async_mpi_finalize 1")],
                         ids=["no-ulfm", "no-async-finalize"])
def test_refused_without_the_launch_flags(openmpi, tmp_path, launch, missing):
    proc, result = job(openmpi, tmp_path, 2, launch=launch)
    assert result is None and proc.returncode != 0
    assert "fault_tolerance=True cannot survive a lost rank here" in proc.stderr, proc.stderr[-4000:]
    assert missing in proc.stderr and "--with-ft ulfm --mca async_mpi_finalize 1" in proc.stderr


def test_an_error_after_a_recovery_ends_the_job_naming_its_rank(openmpi, tmp_path):
    """After the recovery the exception hook aborts over the survivors' engine: a survivor's uncaught error
    ends the job with the hang report naming it (by its rank among the survivors)."""
    proc, result = job(openmpi, tmp_path, 3, "--kill", "1:step:1,2:raise:3")
    assert result is None and proc.returncode != 0
    assert "fault_tolerance: lost rank(s)" in proc.stderr and "world rank 2 raises in step 3" in proc.stderr, \
        proc.stderr[-4000:]
    assert "rank 1 of 2 failed with an uncaught RuntimeError" in proc.stderr, proc.stderr[-4000:]
    assert "culprit: rank(s) 1 (raised an exception)" in proc.stderr, proc.stderr[-4000:]
