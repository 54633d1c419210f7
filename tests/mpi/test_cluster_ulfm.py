"""fault_tolerance=True under Open MPI with ULFM across the 2-node box (jobs/cluster/up.sh).

Each job runs 2 nodes x 2 ranks (sbatch; Open MPI's mpiexec inside the allocation starts a prted on each
node through srun, and the ranks talk over the nodes' link by TCP) and trains workers/ulfm.py at stage 3
with reproducible=True and recovery points in memory.

- Node2's two ranks SIGKILLed at once in step 2 (its prted stays): ranks 0-1 on node1 notice, recover from
  the copies they hold of ranks 2-3's points (at 4 ranks rank r's copy lives N // 2 places on: on node1),
  finish the 4 steps at world size 2 and end with the SHA-256 of the parameters, masters and optimizer
  state that the same run without a failure trains (reproducible=True: the same at any world size; run by
  the same worker on 2 ranks of this machine).
- Every process of the job on node2 SIGKILLed (its slurmstepd, prted and ranks: the node is gone): Open
  MPI 5.0's runtime (PRRTE 3.0) cannot run on without a daemon ("PRTE has lost communication with a remote
  daemon ... will terminate the job"), so the survivors are usually ended by it, and the job must end
  promptly, not hang; a survivor that recovers and finishes first must hold the failure-free bits. PRRTE's
  master merged support for lost daemons in 2026 (openpmix/prrte#2443); where the runtime has it, the
  survivors always finish, and this case should become the first case's check.

Its own cluster (test_cluster.py's fixture): the kills leave node2's slurmd alone, but the module does not
share a cluster another module's jobs use.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .launcher import ROOT, WORKERS, mpi_env
from .openmpi_venv import openmpi_venv
from .test_cluster import cluster, kill_the_jobs_processes_on_node2  # noqa: F401  (cluster: the module's own)
from .test_cluster import _until

WHOLE_NODE_STEPS = 30  # the whole-node case: 28 steps after the loss, for the runtime to end the job in
ULFM = ("--with-ft", "ulfm", "--mca", "async_mpi_finalize", "1")
BATCH = """#!/bin/bash
"$OMPI/bin/mpiexec" {ulfm} --mca btl tcp,self --map-by ppr:2:node -n 4 \\
    "$OMPI/bin/python" -m mpi4py tests/mpi/workers/ulfm.py --out "$OUT" --stage 3 $EXTRA
echo "mpiexec exit $?"
"""


@pytest.fixture(scope="module")
def openmpi():
    return openmpi_venv("Open MPI with ULFM", ", --with-ft ulfm")


def _failure_free(openmpi, tmp_path_factory, *extra: str) -> str:
    """The digest of workers/ulfm.py's training with ``extra`` and no failure, on 2 ranks of this machine
    (reproducible=True: the bits of any world size)."""
    out = tmp_path_factory.mktemp("failure-free") / "out.json"
    proc = subprocess.run([str(openmpi / "bin" / "mpiexec"), "--mca", "btl", "self,sm", "--oversubscribe", "-n", "2",
                           str(openmpi / "bin" / "python"), "-m", "mpi4py", str(WORKERS / "ulfm.py"), "--out", str(out),
                           "--stage", "3", "--ft", "off", *extra], cwd=ROOT, env=mpi_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-6000:]
    return json.loads(out.read_text())["digest"]


@pytest.fixture(scope="module")
def failure_free(openmpi, tmp_path_factory) -> str:
    """The digest of the same training without a failure (4 steps), on 2 ranks of this machine."""
    return _failure_free(openmpi, tmp_path_factory)


def _ended(log: Path) -> bool:
    return log.exists() and "mpiexec exit" in log.read_text()


def _submit(cluster, openmpi, tmp_path, *extra: str) -> tuple[str, Path, Path]:
    """A 2 x 2 job of workers/ulfm.py with ``extra``: its id, its log and its result file."""
    out, log, script = cluster.dir / "shared" / f"{tmp_path.name}.json", tmp_path / "job.out", tmp_path / "job.sbatch"
    script.write_text(BATCH.format(ulfm=" ".join(ULFM)))
    env = {k: v for k, v in mpi_env().items() if k.startswith(("OMPI_", "PRTE_", "PMIX_"))}
    job = cluster.submit("-N", "2", "--ntasks-per-node=2", "--time=5", f"--output={log}", str(script),
                         env=dict(OMPI=str(openmpi), OUT=str(out), EXTRA=" ".join(extra), OMP_NUM_THREADS="1", **env))
    return job, log, out


def test_a_nodes_ranks_lost_under_ulfm_the_other_node_finishes_with_the_failure_free_bits(cluster, openmpi,
                                                                                         failure_free, tmp_path):
    """Break guarded: each rank's copy on the next rank (buddy offset 1: a node's ranks hold each other's
    copies, and the node takes both with it); the recovery's own are test_ulfm.py's."""
    job, log, out = _submit(cluster, openmpi, tmp_path, "--kill", "2:step:2,3:step:2")
    try:
        _until(lambda: _ended(log), 240, "the survivors did not finish", cluster, job, log)
    finally:
        cluster.login("scancel", job)
    text = log.read_text()
    assert out.exists(), text[-6000:]
    result = json.loads(out.read_text())
    assert result["hosts"] == ["node1", "node1", "node2", "node2"], result["hosts"]  # the ranks at the start
    assert result["world"] == 2 and result["steps"] == 4, result
    assert sorted(r for report in result["reports"] for r in report["lost_world"]) == [2, 3], result["reports"]
    assert result["digest"] == failure_free, "the survivors' bits differ from the failure-free run"
    assert "fault_tolerance: lost rank(s)" in text and "mpiexec exit 0" in text, text[-4000:]


def test_a_whole_node_lost_under_ulfm_ends_the_job_promptly(cluster, openmpi, tmp_path, tmp_path_factory):
    """After step 1 the ranks wait (workers/ulfm.py --pause-after) while node2's processes are killed; the
    training then has 28 steps to go. The runtime's end of the job and the survivors' recovery race: the
    runtime usually ends them first, but a survivor may finish its 28 steps before the runtime's word
    arrives (seen once in CI, on a loaded machine). Either way the job ends promptly, and whatever the
    survivors write is the failure-free run's bits."""
    started, go = cluster.dir / "shared" / "started", cluster.dir / "shared" / "go"
    job, log, out = _submit(cluster, openmpi, tmp_path, "--steps", str(WHOLE_NODE_STEPS), "--pause-after", "1",
                            "--started", str(started), "--go", str(go))
    try:
        _until(started.exists, 240, f"job {job} did not reach its pause", cluster, job, log)
        kill_the_jobs_processes_on_node2(cluster)
        go.write_text("")
        took = _until(lambda: _ended(log), 60, "the job did not end", cluster, job, log)
    finally:
        cluster.login("scancel", job)
    text = log.read_text()
    assert "PRTE has lost communication with a remote daemon" in text and "on node node2" in text, text[-4000:]
    if out.exists():  # the survivors recovered and finished before the runtime ended them
        result = json.loads(out.read_text())
        assert result["world"] == 2 and result["steps"] == WHOLE_NODE_STEPS, result
        assert sorted(r for report in result["reports"] for r in report["lost_world"]) == [2, 3], result["reports"]
        assert result["digest"] == _failure_free(openmpi, tmp_path_factory, "--steps", str(WHOLE_NODE_STEPS)), \
            "the survivors finished with bits other than the failure-free run's"
    print(f"job {job} ended {took:.1f} s after node2's processes were killed; "
          f"{'the survivors finished first' if out.exists() else 'the runtime ended the survivors'}")
