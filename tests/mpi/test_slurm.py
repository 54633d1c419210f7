"""The Slurm job scripts on a real one-node Slurm started for this module (jobs/ci/slurm_up.sh).

jobs/slurm/train.sbatch trains the tiny GPT on 2 ranks, started by mpiexec
inside the allocation and by srun --mpi=pmi2; both must reach world size 2,
not two singletons. A USR1 before the time limit must checkpoint, requeue and
resume. Mismatched PMI must fail loudly: srun --mpi=pmix aborts in the pip
MPICH's MPI_Init, and srun --mpi=none gives real singletons, which
zerompi.comm.launch_check must refuse with its hint. Every Slurm command runs under
``timeout``; Slurm is stopped again by jobs/ci/slurm_down.sh.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..components import MISSING, ran, unavailable
from .launcher import ROOT

SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
TINY = ("--config", "jobs/configs/tiny.toml")
SINGLETON_HINT = "but MPI sees a world of 1 on every rank"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}


def _can_have_slurm() -> str | None:
    """Why Slurm cannot be had here, or None when it is installed or installable."""
    if all(shutil.which(t, path=SBIN) for t in ("slurmctld", "slurmd", "sbatch", "srun")):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "Slurm (slurmctld, slurmd, slurm-client) is not installed and this is not root with apt-get"
    return None


class Slurm:
    """Commands against the test cluster, with the job environment the scripts expect."""

    def __init__(self, conf: str, tmp: Path):
        # A clean environment: no SLURM_* of an enclosing job (pytest itself may run under Slurm).
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_"))}
        env.update(SLURM_CONF=conf, PATH=SBIN, ZEROMPI_PYTHON=sys.executable,
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   MPIR_CVAR_POLLS_BEFORE_YIELD="1", MPIR_CVAR_POSIX_POLL_FREQUENCY="1")
        self.env, self.tmp, self.submitted = env, tmp, 0

    def run(self, *cmd: str, limit: int = 30, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["timeout", str(limit), *cmd], capture_output=True, text=True, cwd=ROOT,
                              env={**self.env, **(env or {})}, timeout=limit + 10)

    def submit(self, name: str, *train_args: str, env: dict | None = None,
               script: str = "jobs/slurm/train.sbatch") -> tuple[str, Path]:
        """sbatch ``script`` (train.sbatch) on 2 tasks; returns the job id and its output file."""
        self.submitted += 1
        out = self.tmp / f"{name}-{self.submitted}.out"  # requeued runs append to it
        proc = self.run("sbatch", "--parsable", "--ntasks=2", "--overcommit", "--time=5",
                        f"--output={out}", f"--job-name={name}", script, *train_args,
                        env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0], out

    def state(self, job: str) -> str:
        """PENDING, RUNNING, COMPLETED, FAILED, ...: squeue shows finished jobs for MinJobAge (5 min)."""
        return self.run("squeue", "-h", "-j", job, "-t", "all", "-o", "%T").stdout.strip()

    def wait(self, job: str, limit: float = 300, until=None) -> str:
        """Poll until the job reaches a final state (or ``until()`` holds); returns its state. ``limit`` only
        catches a hang (these jobs take seconds; start-up, a save, a requeue and a restart take longer loaded).

        Only a final state counts as done: a squeue that times out under load prints nothing,
        which must not end the wait.
        """
        deadline, held = time.monotonic() + limit, 0.0
        while time.monotonic() < deadline:
            if until is not None and until():
                return self.state(job)
            state = self.state(job)
            if state in FINAL:
                return state
            if self.run("squeue", "-h", "-j", job, "-o", "%r").stdout.strip() == "BeginTime":
                # A requeued job waits ~2 minutes before it may start again; let it start sooner,
                # but not within the second its old credential was revoked: slurmd compares
                # whole seconds and would kill the restart ("Job credential revoked").
                held = held or time.monotonic()
                if time.monotonic() - held > 2:
                    self.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            time.sleep(0.25)
        self.run("scancel", job)
        raise AssertionError(f"job {job} still {self.state(job)} after {limit} s")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _can_have_slurm()
    if why:
        unavailable("Slurm", why)
    scratch = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["timeout", "300", "bash", str(ROOT / "jobs/ci/slurm_up.sh"), str(scratch)],
                        capture_output=True, text=True, env={**os.environ, "PATH": SBIN})
    if up.returncode != 0:
        subprocess.run(["bash", str(ROOT / "jobs/ci/slurm_down.sh"), str(scratch)], capture_output=True)
        MISSING["Slurm"] = f"slurm_up.sh failed ({up.returncode})"
        pytest.fail(f"slurm_up.sh failed ({up.returncode}):\n{up.stderr[-4000:]}")
    cluster = Slurm(up.stdout.strip().splitlines()[-1], tmp_path_factory.mktemp("jobs"))
    ran("Slurm", f"{cluster.run('sinfo', '--version').stdout.strip()} (slurmctld + slurmd on this node)")
    try:
        yield cluster
    finally:
        subprocess.run(["timeout", "60", "bash", str(ROOT / "jobs/ci/slurm_down.sh"), str(scratch)],
                       capture_output=True)


def _log(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.parametrize("launch", ("mpiexec", "srun"))
def test_train_sbatch_trains_on_two_ranks(slurm, tmp_path, launch):
    out_dir = tmp_path / "out"
    job, log = slurm.submit(f"train-{launch}", *TINY, "--steps", "10", "--out", str(out_dir),
                            env=dict(ZEROMPI_LAUNCH=launch, ZEROMPI_PMI="pmi2", ZEROMPI_LOG_LEVEL="INFO"))
    state = slurm.wait(job)
    text = _log(log)
    assert state == "COMPLETED", text[-4000:]
    launcher = "srun --mpi=pmi2" if launch == "srun" else "mpiexec -n 2"
    assert launcher in text.splitlines()[0], text[:400]
    # One job of two ranks, not two singletons: one "done" line, and a rank 1 exists.
    assert text.count("done: ") == 1 and "done: 10 steps, world size 2" in text, text[-4000:]
    assert "[rank 1] INFO train_gpt" in text and "[rank 0] INFO train_gpt" in text
    assert json.loads((out_dir / "config.json").read_text())["world_size"] == 2
    assert json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 10


def test_finetune_lora_sbatch(slurm, tmp_path):
    """finetune_lora.sbatch: train.sbatch running jobs/finetune_lora.py (peft, a sharded frozen base)."""
    out_dir = tmp_path / "out"
    job, log = slurm.submit("lora", "--steps", "2", "--out", str(out_dir), script="jobs/slurm/finetune_lora.sbatch")
    state = slurm.wait(job, limit=240)
    text = _log(log)
    assert state == "COMPLETED", text[-4000:]
    assert "jobs/finetune_lora.py" in text.splitlines()[0] and "done: 2 steps, world size 2" in text, text[-4000:]
    assert (out_dir / "adapter" / "adapter_config.json").is_file()


def test_usr1_checkpoints_requeues_and_resumes(slurm, tmp_path):
    # --signal=B:USR1 reaches the batch script; this sends the same signal by hand.
    out_dir = tmp_path / "out"
    job, log = slurm.submit("requeue", *TINY, "--steps", "100000", "--out", str(out_dir),
                            env=dict(ZEROMPI_LAUNCH="srun"))
    slurm.wait(job, until=lambda: "step 1/100000" in _log(log))
    assert slurm.run("scancel", "--batch", "--signal=USR1", job).returncode == 0
    slurm.wait(job, until=lambda: "resumed from" in _log(log))
    slurm.run("scancel", job)
    slurm.wait(job)
    text = _log(log)
    assert "forwarding it to the ranks" in text and "requeueing job" in text, text[-4000:]
    saved = int(text.split("preempted: checkpoint at step ")[1].split()[0])
    assert f"job {job} (restart 1)" in text, text[-4000:]
    assert text.splitlines()[0].endswith(str(out_dir)), text[:400]
    restart = next(line for line in text.splitlines() if "(restart 1)" in line)
    assert restart.endswith("--resume"), restart
    assert f"resumed from {out_dir / 'checkpoints'} at step {saved + 1}" in text, text[-4000:]


CHECK = """\
from mpi4py import MPI
from zerompi.comm.launch_check import check_world_matches_launcher

size = MPI.COMM_WORLD.Get_size()
check_world_matches_launcher(size)
print(f"world {size}: ok", flush=True)
"""


@pytest.mark.parametrize("plugin", ("pmi2", "none", "pmix"))
def test_launch_check_under_srun(slurm, tmp_path, plugin):
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    proc = slurm.run("srun", f"--mpi={plugin}", "--ntasks=2", "--overcommit", "--kill-on-bad-exit=1",
                     sys.executable, "-m", "mpi4py", str(script), limit=60)
    out = proc.stdout + proc.stderr
    if plugin == "pmi2":
        assert proc.returncode == 0 and out.count("world 2: ok") == 2, out
        return
    assert proc.returncode != 0 and "world 1: ok" not in out, out
    if plugin == "none":  # real singletons: refused with the hint
        assert f"srun started 2 tasks (SLURM_STEP_NUM_TASKS=2, --mpi=none) {SINGLETON_HINT}" in out, out
        assert "try srun --mpi=pmi2, or mpiexec inside the allocation" in out
    else:  # the pip MPICH cannot speak PMIx: MPI_Init itself aborts
        assert "PMI" in out, out


def test_train_sbatch_with_pmix_fails_loudly(slurm, tmp_path):
    job, log = slurm.submit("pmix", *TINY, "--steps", "2", "--out", str(tmp_path / "out"),
                            env=dict(ZEROMPI_LAUNCH="srun", ZEROMPI_PMI="pmix"))
    state = slurm.wait(job)
    text = _log(log)
    assert state == "FAILED" and "done: " not in text, text[-4000:]


def test_train_sbatch_refuses_singletons(slurm, tmp_path):
    if "check_world_matches_launcher" not in (ROOT / "zerompi" / "comm" / "launch.py").read_text():
        # Until then the job would train two singletons; no need to spend the time watching it.
        pytest.xfail("zerompi.comm.launch.discover does not call launch_check.check_world_matches_launcher yet")
    job, log = slurm.submit("singletons", *TINY, "--steps", "2", "--out", str(tmp_path / "out"),
                            env=dict(ZEROMPI_LAUNCH="srun", ZEROMPI_PMI="none"))
    state = slurm.wait(job)
    text = _log(log)
    assert state == "FAILED" and "world size 1" not in text, text[-4000:]
    assert SINGLETON_HINT in text
