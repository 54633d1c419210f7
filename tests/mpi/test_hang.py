"""A hang names its culprit: one rank misbehaves (workers/hang.py), rank 0's report names it, its
collective and its stack, and the job ends with exit code 4 within the watchdog's own waits of the fault
(named_within: 10 s at hang_floor=2 s, 15 s where the deputy reports for a silent rank 0) and a slack.

hang_floor=2 s here; the default is 60 s. Each case is one mpiexec job of about 5-10 s, mostly waiting;
the module's jobs run three at a time, before its tests judge them.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from zerompi.comm.looks import LOOK_GAP, look_wait, poll_every
from zerompi.comm.watchdog import ABORT_GRACE, GATHER_WAIT, HANG_CODE, deputy_wait
from zerompi.tools.cli import main

from .launcher import ROOT, WORKERS, mpi_env, mpiexec, rank_python

FLOOR = 2.0  # workers/hang.py's hang_floor: the deadline at these step times (3 median steps are less)
SLACK = 3.0  # seconds for the launcher's teardown and the polls' jitter, on a machine of its own


def named_within(load: float | None = None, deputy: bool = False) -> float:
    """Seconds from the fault to the job's end, from the watchdog's own waits: the deadline and the poll
    that notices it, two looks at the ranks' counts (each waiting for answers) a gap apart, with a poll's
    delay, the report's wait for the records of missing ranks and the grace before MPI_Abort; ``deputy``
    (rank 0 is the silent one): the deputy's wait for rank 0's report first. Plus SLACK, stretched by how
    many runnable processes share each core (``load``: the load average the job ended at, else now's).
    At hang_floor=2 s: 10 s of waits, 15 s with the deputy's."""
    waits = (FLOOR + poll_every(FLOOR) + 2 * look_wait(FLOOR) + LOOK_GAP * FLOOR + poll_every(FLOOR)
             + GATHER_WAIT + ABORT_GRACE + (deputy_wait() if deputy else 0.0))
    load = os.getloadavg()[0] if load is None else load
    return waits + SLACK * max(1.0, load / (os.cpu_count() or 1))


class Job:
    def __init__(self, n: int, fault: str, directory: Path, *extra: str):
        self.directory = directory
        cmd = [*mpiexec(), "-n", str(n), *rank_python(fresh=True), "-m", "mpi4py", str(WORKERS / "hang.py"),
               "--fault", fault, "--dir", str(directory), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=180)
        self.ended, self.load = time.time(), os.getloadavg()[0]
        self.rc, self.err, self.out = proc.returncode, proc.stderr, proc.stdout
        fault_time = directory / "fault.time"
        self.fault = float(fault_time.read_text()) if fault_time.exists() else None

    def section(self, rank: int) -> str:
        """The culprit block of the report for ``rank`` (its line and stack)."""
        m = re.search(r"^culprit: .*?\n((?:  .*\n)*?)(?:first divergence|every rank)", self.err, re.M)
        assert m, self.err[-4000:]
        block = m.group(1)
        start = block.index(f"  rank {rank}: ")
        nxt = re.search(r"^  rank \d+: ", block[start + 3:], re.M)
        return block[start:start + 3 + nxt.start()] if nxt else block[start:]


# fault, ranks, what the culprit's line says, a frame of its stack (None: no stack, a missing rank)
CASES = [
    ("extra_microbatch", 2, "waiting", "in train_step: engine.backward(engine(load_batch"),
    ("skip_module", 3, "waiting", "in train_step"),
    ("loader_sleep", 2, "not in a collective: in user code", "in load_batch: time.sleep(600)"),
    ("busy_loop", 4, "not in a collective: in user code", "in train_step: spin()"),
    ("sigstop", 2, "missing", None),
    ("raise", 3, "raised RuntimeError: boom in user code", "in train_step: raise RuntimeError"),
    ("user_barrier", 4, "not in a collective: in user code", "in train_step: USER.Barrier()"),
    ("branch", 3, "waiting", "in train_step"),
    ("step_early", 2, "raised UsageError: step() called before backward()", "in train_step: return engine.step()"),
    ("oom", 4, "raised RuntimeError", "in forward: torch.empty(2**62"),
    # metadata exchanges run on a communicator of their own (MPIGroup.separate_metadata), so the lone
    # save waits there instead of meeting the others' all-gather
    ("save_alone", 3, "waiting", "in train_step: engine.save_checkpoint("),
]


# every case with the culprit at rank 0, a middle rank (from 3 ranks) and the last rank: a report that
# decided by rank order, or a tie by majority, would name a bystander at one of them
PLACED = [(*case, culprit) for case in CASES for culprit in sorted({0, case[1] // 2, case[1] - 1})]


PLACED_IDS = [f"{c[0]}-np{c[1]}-rank{c[4]}" for c in PLACED]
CONCURRENT = 3  # a hang job mostly waits (its deadline, the report's gathering): a few share the cores
# every job of this module: id -> (ranks, fault, worker arguments); "{blocker}" is a regular file's path
SPECS = {cid: (case[1], case[0], ("--culprit", str(case[4]))) for cid, case in zip(PLACED_IDS, PLACED)}
SPECS.update({f"config-rank{c}": (3, "bucket_size", ("--culprit", str(c))) for c in (0, 1, 2)})
SPECS.update({f"thread-{f}": (2, f, ("--progress", "thread")) for f in ("loader_sleep", "extra_microbatch")})
SPECS.update({"divergence": (3, "skip_module", ()), "diagnose": (2, "loader_sleep", ()),
              "healthy-closed": (3, "none", ("--steps", "8")),
              "healthy-left-open": (3, "none", ("--steps", "8", "--no-close")), "sigkill": (2, "sigkill", ()),
              "unwritable": (2, "loader_sleep", ("--records", "{blocker}/records"))})


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Job]:
    """Every job of SPECS, CONCURRENT at a time (each in a directory of its own)."""
    dirs = {key: tmp_path_factory.mktemp(key) for key in SPECS}  # mktemp is not for threads

    def one(key: str) -> Job:
        n, fault, args = SPECS[key]
        blocker = dirs[key] / "file"
        blocker.write_text("")
        (dirs[key] / "d").mkdir()
        return Job(n, fault, dirs[key] / "d", *(a.format(blocker=blocker) for a in args))
    with ThreadPoolExecutor(CONCURRENT) as pool:
        return dict(zip(SPECS, pool.map(one, SPECS)))


@pytest.mark.parametrize("fault,n,where,frame,culprit", PLACED, ids=PLACED_IDS)
def test_hang_report_names_the_culprit(jobs, request, fault, n, where, frame, culprit):
    job = jobs[request.node.callspec.id]
    assert job.rc == HANG_CODE, (job.rc, job.err[-6000:])
    assert f"\nculprit: rank(s) {culprit} (" in job.err, job.err[-6000:]
    section = job.section(culprit)
    assert where in section, section
    if frame is not None:
        assert frame in section, section
    # rank 0 silent (stopped): the deputy reports, after waiting for rank 0's report
    within = named_within(job.load, deputy=culprit == 0 and fault == "sigstop")
    assert job.ended - job.fault < within, (job.ended - job.fault, within, job.load, job.err[-3000:])


@pytest.mark.parametrize("culprit", [0, 1, 2])
def test_a_rank_with_another_config_is_named_at_initialize(jobs, culprit):
    """Another bucket_mb on one rank (its buckets, and its first broadcast, would differ): every rank
    stops at initialize naming the key and each rank's value, before any collective can hang or
    mismatch (rank 0's larger broadcast once failed on its peers as "Message truncated")."""
    job = jobs[f"config-rank{culprit}"]
    others = sorted({0, 1, 2} - {culprit})
    assert job.rc != 0 and "ConfigError: the config differs between ranks: bucket_mb: " in job.err, job.err[-4000:]
    assert (f"0.001 on rank(s) [{culprit}]" in job.err and f"0.0001 on rank(s) {others}" in job.err), job.err[-4000:]


@pytest.mark.parametrize("fault,where", [("loader_sleep", "not in a collective"), ("extra_microbatch", "waiting")])
def test_hang_report_with_the_communication_thread_and_prefetch(jobs, fault, where):
    """mpi_progress='thread' runs every collective on another thread; the report is the same."""
    job = jobs[f"thread-{fault}"]
    assert job.rc == HANG_CODE and "\nculprit: rank(s) 1 (" in job.err, job.err[-6000:]
    assert where in job.section(1)


def test_skipped_module_first_divergence_names_both_modules(jobs):
    job = jobs["divergence"]
    div = job.err[job.err.index("first divergence"):job.err.index("every rank:")]
    assert "rank(s) 0-1: all_gather of 288 B for bucket 1 [mid.weight ...] of module 'mid'" in div, div
    assert "rank(s) 2: all_gather of 288 B for bucket 2 [fc2.weight ...] of module 'fc2'" in div, div


def test_diagnose_reads_the_records_a_dead_job_left(jobs, capsys):
    job = jobs["diagnose"]
    assert job.rc == HANG_CODE
    assert sorted(p.name for p in job.directory.glob("rank-*.json")) == ["rank-00000.json", "rank-00001.json"]
    assert main(["diagnose", str(job.directory)]) == 0
    out = capsys.readouterr().out
    report = job.err[job.err.index("zerompi hang report"):job.err.index("records: ")]
    assert out == report
    assert out == (job.directory / "report.txt").read_text().split("records: ")[0]


@pytest.mark.parametrize("close", (True, False), ids=("closed", "left-open"))
def test_a_healthy_job_ends_normally_and_leaves_no_records(jobs, request, close):
    """The watchdog thread polls MPI; left running at exit it must stop before MPI is finalised."""
    job = jobs[f"healthy-{request.node.callspec.id}"]
    assert job.rc == 0 and "no hang" in job.out, job.err[-4000:]
    assert "zerompi" not in job.err and not list(job.directory.glob("rank-*.json"))


def test_sigkill_ends_the_job_through_the_launcher(jobs):
    """MPICH's mpiexec ends the job when a rank dies: no hang to diagnose (sigstop stands in for a
    killed rank under a launcher that leaves the others waiting)."""
    job = jobs["sigkill"]
    assert job.rc != 0 and job.ended - job.fault < named_within(job.load)


def test_an_unwritable_hang_dir_still_reports_and_aborts(jobs):
    job = jobs["unwritable"]
    records = job.directory.parent / "file" / "records"  # under a regular file: cannot be created
    assert job.rc == HANG_CODE and "\nculprit: rank(s) 1 (" in job.err, job.err[-4000:]
    assert f"records: not written ({records}" in job.err
