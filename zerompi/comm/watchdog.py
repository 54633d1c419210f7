"""Hang protection: when a collective is overdue, name the culprit rank, then abort the job.

A rank stuck in a collective (a peer died, took another code path, or is stuck in user code)
would otherwise hold the whole allocation until walltime. Every blocking wait of every group of
the process goes through :meth:`Watchdog.blocked`; a daemon thread checks it a few times per
deadline. The deadline is ``collective_timeout`` when set, else ``max(hang_floor, FACTOR x the
running median step time)`` (recorder.py), so no configuration is needed.

When a wait is overdue, this rank first looks whether the job still moves: it asks every rank for
its count of collectives issued, twice, a quarter of a deadline apart. If any count changed (a
loaded machine, a slow first step), nothing is stuck yet and it looks again later; only when two looks
agree (or the wait has lasted ten deadlines, so that a job that moves forever without this rank still
ends) does it blame: the rule is looks.py's. Then it prints what it waits in (the per-rank message) and asks every
rank, over a side channel that does not depend on the stuck collective (point-to-point messages
on a duplicate communicator, mpi/side.py), for its record: the ring of its last collectives and the
stack of its training thread. Every rank's watchdog thread polls that channel, so a rank in user
code answers too. Each rank writes its record to ``hang_dir`` (for ``zerompi diagnose``); rank 0
gathers the records for at most :data:`GATHER_WAIT` seconds, prints one report (diagnosis.py)
naming the culprit and calls ``abort(HANG_CODE)``. Every record, rank 0's included, goes to rank 1 too,
the deputy: where rank 0 is the rank that hangs (stopped, or stuck where its watchdog cannot run) and
makes no report, the deputy reports from what it received, naming rank 0, and aborts the job.

A rank that raises is the culprit whatever fired first: its exception goes into every record it sends
from then on, and where a report was already under way (its watchdog fired, or answered another
rank's request) it sends its record again, with the exception, to rank 0 and the deputy, and leaves
the abort to the report.

Degraded paths never wait longer than that: with no side channel (an in-process group, MPI
without ``MPI_THREAD_MULTIPLE``) a rank aborts with :data:`ABORT_CODE` after its message, as
before; a directory that cannot be written is named in the report and skipped; a rank that sent
its record and is not aborted by rank 0 or the deputy within ``GATHER_WAIT + 2 ABORT_AFTER`` aborts
by itself.
"""
from __future__ import annotations

import atexit
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Protocol

from zerompi.comm import diagnosis
from zerompi.comm.looks import MOVING_LIMIT, Looks, Verdict, look_wait, poll_every
from zerompi.comm.recorder import Event, Recorder

ABORT_GRACE = 0.5  # seconds between printing why the job aborts and MPI_Abort
ABORT_CODE = 3     # exit code of a watchdog abort without a report (per-rank message only)
HANG_CODE = 4      # exit code of a watchdog abort after rank 0's hang report
FACTOR = 3.0       # default deadline: this many median step times (at least hang_floor)
GATHER_WAIT = 3.0  # seconds rank 0 waits for the other ranks' records
ABORT_AFTER = 3.0  # further seconds a rank that sent its record waits for rank 0 to abort the job
DEPUTY_AFTER = 2.0  # seconds after GATHER_WAIT the deputy waits for rank 0's abort before it reports
DEPUTY = 1
TAG_REQUEST, TAG_RECORD, TAG_PROBE, TAG_PROGRESS = 1, 2, 3, 4


def deputy_wait() -> float:
    """Seconds after its record the deputy waits for rank 0's abort before it reports itself."""
    return GATHER_WAIT + DEPUTY_AFTER


def answered_wait() -> float:
    """Further seconds the deputy gives rank 0, once rank 0 has sent its record (it is reporting), to abort."""
    return 2 * ABORT_AFTER


def lone_wait() -> float:
    """Seconds after its record a rank that neither reports nor is the deputy waits before it aborts alone."""
    return GATHER_WAIT + 2 * ABORT_AFTER


class Overdue(NamedTuple):
    """What this rank waits in, and for how long (seconds)."""

    what: str
    waited: float


class HangPolicy(NamedTuple):
    """When a wait is overdue, and where records go."""

    timeout: float | None     # collective_timeout: a fixed deadline, overriding the automatic one
    floor: float | None       # hang_floor: the automatic deadline's minimum; None turns it off
    directory: str | None     # hang_dir: where each rank writes its record on abort

    def deadline(self, median_step: float | None) -> float | None:
        """Seconds a wait may last, given the running median step time (None: no deadline)."""
        if self.timeout is not None:
            return self.timeout
        if self.floor is None:
            return None
        return self.floor if median_step is None else max(self.floor, FACTOR * median_step)

    @property
    def active(self) -> bool:
        return self.timeout is not None or self.floor is not None


class Channel(Protocol):
    """Small point-to-point messages that do not depend on any collective (mpi.SideChannel)."""

    def post(self, dest: int, tag: int, obj: Any) -> None: ...
    def poll(self, tag: int) -> list[tuple[int, Any]]: ...
    def flush(self) -> bool: ...


JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "COBALT_JOBID")  # a batch job's id


def default_directory(job: str) -> str:
    """Where records go when ``hang_dir`` is not set: a temporary directory named after the job."""
    return os.path.join(tempfile.gettempdir(), f"zerompi-hang-{job}")


def batch_job() -> str | None:
    """This batch job's id (Slurm, PBS, LSF, Flux, Cobalt), or None outside one."""
    return next((os.environ[k] for k in JOB_VARIABLES if os.environ.get(k)), None)


class Watchdog:
    """What this process is blocked in, since when; and the thread that diagnoses and aborts."""

    def __init__(self) -> None:
        # (what, time.monotonic() when it started, the recorder's event number or None)
        self.waiting: tuple[str, float, int | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None

    @contextmanager
    def blocked(self, what: str, group: str = "", event: Event | None = None) -> Iterator[None]:
        """Record that this rank waits in ``what`` (on the group labelled ``group``, "" for one
        spanning the job) for the duration of the block; ``event`` (recorder.py) ends with it."""
        self.waiting = (what + (f" (group {group})" if group else ""), time.monotonic(),
                        None if event is None else event.index)
        try:
            yield
        finally:
            self.waiting = None
            if event is not None:
                event.end = time.monotonic()

    def overdue(self, timeout: float, now: float) -> Overdue | None:
        """The wait that has lasted longer than ``timeout`` seconds at ``now``, if any."""
        waiting = self.waiting
        if waiting is not None and now - waiting[1] > timeout:
            return Overdue(waiting[0], now - waiting[1])
        return None

    def start(self, policy: HangPolicy, rank: int, size: int, abort: Callable[[int], None],
              recorder: Recorder, channel: Channel | None = None, hosts: tuple[str, ...] = ()) -> None:
        """Start checking (once per process: later calls change nothing). ``hosts``: each rank's host, so
        that a report names the host of a rank that does not answer."""
        if self._thread is None and policy.active:
            self._job = _Job(policy, rank, size, abort, recorder, channel, self._stop, hosts)
            self._thread = threading.Thread(target=self._watch, args=(self._job,), daemon=True,
                                            name="zerompi-watchdog")
            self._thread.start()
            atexit.register(self.stop)  # before MPI is finalised at exit: no MPI call from the thread after it

    def stop(self) -> None:
        """Stop checking; waits (at most a second) for the thread to leave any MPI call it is in."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout=1.0)

    def report_failure(self, error: str, stack: list[str]) -> bool:
        """An uncaught exception ends this rank: send the hang report's request naming it (rank 0
        then reports and aborts the job). Where a report is already under way, this rank's record
        goes again with the exception, and this waits (boundedly) for that report to end the job.
        False, having done nothing, when there is no side channel or the watchdog was stopped (its engine
        was closed, or dropped after a lost rank: its channel may hold a dead rank); the caller aborts as before."""
        job = self._job
        if job is None or job.channel is None or self._stop.is_set():
            return False
        job.failure = {"error": error, "stack": stack}
        if job.claim():
            job.run(self, f"rank {job.rank} raised {error}", announce=True)
            return True
        job.amend(self)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(deputy_wait() + 3 * ABORT_AFTER)
        return True

    def _watch(self, job: "_Job") -> None:
        looks = Looks()  # the last look at the ranks' counts during the current overdue wait
        while True:
            deadline = job.policy.deadline(job.recorder.median_step())
            if self._stop.wait(poll_every(deadline)):
                return
            job.answer_probes()
            now = time.monotonic()
            late = self.overdue(deadline, now) if deadline is not None else None
            asked = job.channel.poll(TAG_REQUEST) if job.channel is not None else []
            verdict = looks.next(now, None if late is None else late.waited, deadline)
            if late is not None and not asked and job.channel is not None:  # else blame (or answer) at once
                if verdict is Verdict.LOOK:
                    verdict = looks.saw(time.monotonic(), job.look(look_wait(deadline)))
                if verdict is Verdict.WAIT:
                    continue
            if (late is None and not asked) or not job.claim():
                continue
            if late is not None:
                moving = (f"; other ranks still issued collectives after {MOVING_LIMIT} deadlines"
                          if verdict is Verdict.STILL_MOVING else "")
                trigger = (f"rank {job.rank} waited {late.waited:.1f} s in {late.what} ({job.limit(deadline)})"
                           + moving)
                job.say(f"zerompi watchdog: rank {job.rank} of {job.size} has waited {late.waited:.0f} s in "
                        f"{late.what} ({job.limit(deadline)}{moving}); "
                        + ("gathering the hang report, then aborting the job\n" if job.channel is not None
                           else "aborting the job\n"))
            ended = job.run(self, trigger if late is not None else str(asked[0][1]), announce=late is not None)
            if not ended and not self._stop.is_set():
                job.end(ABORT_CODE)
            return


class _Job:
    """What the watchdog thread needs to diagnose: the policy, this rank, the recorder, the channel."""

    def __init__(self, policy: HangPolicy, rank: int, size: int, abort: Callable[[int], None],
                 recorder: Recorder, channel: Channel | None, stopped: threading.Event,
                 hosts: tuple[str, ...] = ()):
        self.policy, self.rank, self.size, self.abort = policy, rank, size, abort
        self.recorder, self.channel, self.stopped, self.hosts = recorder, channel, stopped, tuple(hosts)
        self._claimed = threading.Lock()
        self.failure: dict[str, Any] | None = None  # this rank's uncaught exception: every later record carries it
        self.received: dict[int, dict[str, Any]] = {}  # records sent here (rank 0 and the deputy)
        self._looks = 0

    def claim(self) -> bool:
        """True the first time only: one report per process, from whichever thread gets here first."""
        return self._claimed.acquire(blocking=False)

    def limit(self, deadline: float | None) -> str:
        if self.policy.timeout is not None:
            return f"collective_timeout={self.policy.timeout:g} s"
        return f"deadline {deadline:g} s: hang_floor={self.policy.floor:g} s or {FACTOR:g} median steps"

    @staticmethod
    def say(text: str) -> None:
        os.write(2, text.encode(errors="replace"))

    # ---- is the job still moving? ---------------------------------------------------------------
    def answer_probes(self) -> None:
        """Tell each rank that asked how many collectives this rank has issued."""
        if self.channel is not None:
            for source, serial in self.channel.poll(TAG_PROBE):
                self.channel.post(source, TAG_PROGRESS, (serial, self.recorder.count))

    def look(self, wait: float) -> dict[int, int | None]:
        """Every rank's count of collectives issued (None: no answer within ``wait`` seconds)."""
        self._looks += 1
        counts: dict[int, int | None] = {r: None for r in range(self.size)}
        counts[self.rank] = self.recorder.count
        for r in range(self.size):
            if r != self.rank:
                self.channel.post(r, TAG_PROBE, self._looks)
        end = time.monotonic() + wait
        while None in counts.values() and time.monotonic() < end:
            self.answer_probes()  # another overdue rank may be looking too
            for source, (serial, count) in self.channel.poll(TAG_PROGRESS):
                if serial == self._looks:  # an answer to an earlier look is stale
                    counts[source] = count
            self.channel.flush()
            if self.stopped.wait(0.02):
                break
        return counts

    # ---- the report -----------------------------------------------------------------------------
    def record(self, watchdog: Watchdog, trigger: str) -> dict[str, Any]:
        """This rank's record now, with its exception if it raised."""
        record = self.recorder.snapshot(self.rank, self.size, watchdog.waiting, trigger)
        record.update(self.failure or {})
        if self.hosts and self.rank in (0, DEPUTY):  # the reporters' files name every rank's host
            record["hosts"] = list(self.hosts)
        return record

    def _send(self, record: dict[str, Any]) -> None:
        for to in {0, DEPUTY} - {self.rank}:
            if to < self.size:
                self.channel.post(to, TAG_RECORD, record)

    def amend(self, watchdog: Watchdog) -> None:
        """A report is under way and this rank has just raised: its record goes again, with the exception."""
        record = self.record(watchdog, f"rank {self.rank} raised {self.failure['error']}")
        self._write(record)
        self._send(record)
        self.channel.flush()

    def run(self, watchdog: Watchdog, trigger: str, *, announce: bool) -> bool:
        """Write this rank's record and hand it to rank 0 and the deputy; on rank 0, gather, report and
        abort the job (HANG_CODE): True. False where this rank made no report: the caller aborts alone."""
        if announce and self.channel is not None:
            for r in range(self.size):
                if r != self.rank:
                    self.channel.post(r, TAG_REQUEST, trigger)
        record = self.record(watchdog, trigger)
        where = self._write(record)
        if self.channel is None:
            return False
        self._send(record)  # rank 0's too: the deputy reports from it if rank 0 stops midway
        if self.rank != 0:
            deputy = self.rank == DEPUTY
            if self._linger(deputy_wait() if deputy else lone_wait()):
                return False
            if deputy and 0 in self.received and self._linger(answered_wait()):
                return False  # rank 0 answered, so it is reporting: give it longer
            if not deputy:
                self.say(f"zerompi watchdog: rank {self.rank} of {self.size}: neither rank 0 nor rank {DEPUTY} "
                         f"made a hang report; this rank's record: {where}\n")
                return False
            trigger += f"; rank 0 made no report in {deputy_wait():g} s: rank {DEPUTY} reports"
        self._report(watchdog, trigger, where, wait=0.2 if self.rank else GATHER_WAIT)
        self.end(HANG_CODE)
        return True

    def _write(self, record: dict[str, Any]) -> str:
        """Write this rank's record; returns the directory, or why it could not be written."""
        directory = self.policy.directory
        if directory is None:
            return "not written (no hang_dir)"
        try:
            diagnosis.write_record(directory, record)
            return directory
        except OSError as e:
            return f"not written ({directory}: {e.strerror or e})"

    def _linger(self, seconds: float) -> bool:
        """Keep the posted messages moving (a rank in user code makes no other MPI call) for ``seconds``;
        True if the watchdog was stopped meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._receive()
            if self.stopped.wait(0.05):
                return True
        return False

    def _receive(self) -> None:
        """Keep the latest record of each rank (an amended one replaces the first)."""
        self.received.update((src, rec) for src, rec in self.channel.poll(TAG_RECORD))
        self.channel.flush()

    def _report(self, watchdog: Watchdog, trigger: str, where: str, wait: float) -> None:
        """Gather the other ranks' records for at most ``wait`` seconds; print and save the report."""
        end = time.monotonic() + wait
        while len(self.received | {self.rank: None}) < self.size and time.monotonic() < end:
            self._receive()
            time.sleep(0.05)
        self._receive()
        # this rank's record as it is now: it may have raised since it was first taken
        records = {**self.received, self.rank: self.record(watchdog, trigger)}
        written = where == self.policy.directory
        text = diagnosis.format_report(diagnosis.diagnose(records, self.size, self.hosts), trigger=trigger,
                                       directory=where if written else None)
        self.say(text if written else text + f"records: {where}\n")
        if written:
            try:
                with open(os.path.join(where, diagnosis.REPORT_NAME), "w") as f:
                    f.write(text)
            except OSError:
                pass  # the report is on stderr already

    def end(self, code: int) -> None:
        time.sleep(ABORT_GRACE)  # let the launcher forward the report before it kills us
        self.abort(code)
