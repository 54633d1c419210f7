"""The watchdog's small parts (zerompi/comm/watchdog.py) that the hang tests (test_hang.py) pass through
without looking: the documented numbers, the default records directory, what a blocked wait records and
clears, and a watchdog that never started. Each test names the break it guards against."""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from zerompi.comm import watchdog
from zerompi.comm.recorder import Recorder
from zerompi.comm.watchdog import HangPolicy, Watchdog

def watchdog_threads() -> set[threading.Thread]:
    """The watchdog threads running in this process (a test tells its own apart by the set before it starts)."""
    return {t for t in threading.enumerate() if t.name == "zerompi-watchdog"}


DOC = " ".join((Path(__file__).parents[3] / "docs" / "fault-tolerance.md").read_text().split())


def test_the_documented_waits_and_exit_codes_are_the_ones_used():
    """docs/fault-tolerance.md states each in numbers; a change of either side changes both.
    Breaks guarded: any of the constants changed alone (a report later, or an exit code scripts test)."""
    w = watchdog
    assert w.FACTOR == 3.0 and "max(`hang_floor`, 3 × the running median step time)" in DOC
    assert w.GATHER_WAIT == 3.0 and "Rank 0 waits at most 3 s for the records" in DOC
    assert w.deputy_wait() == 5.0 and "makes no report within 5 s (6 s more when rank 0" in DOC
    assert w.answered_wait() == 6.0 and "(6 s more when rank 0 has sent its record, so is reporting)" in DOC
    assert w.lone_wait() == 9.0 and "aborts by itself 9 s after sending its record" in DOC
    assert w.ABORT_GRACE == 0.5 and "Half a second after printing it" in DOC
    assert w.HANG_CODE == 4 and "the job aborts with **exit code 4**" in DOC
    assert w.ABORT_CODE == 3 and "aborts with exit code 3" in DOC


def test_the_automatic_deadline_is_factor_times_the_median_step_at_least_the_floor():
    policy = HangPolicy(timeout=None, floor=2.0, directory=None)
    assert policy.deadline(None) == 2.0 and policy.deadline(0.1) == 2.0
    assert policy.deadline(10.0) == pytest.approx(30.0)
    assert HangPolicy(timeout=7.0, floor=2.0, directory=None).deadline(10.0) == 7.0
    assert HangPolicy(timeout=None, floor=None, directory=None).deadline(10.0) is None


def test_records_go_under_the_temporary_directory_named_after_the_job():
    """Break guarded: no default directory (records of a job without hang_dir written nowhere)."""
    assert watchdog.default_directory("4242") == os.path.join(tempfile.gettempdir(), "zerompi-hang-4242")


def test_a_blocked_wait_names_its_group_and_is_cleared_when_it_ends():
    """Breaks guarded: the group's label on the wrong waits; a wait left recorded after it ended (every
    later check would find it overdue)."""
    w = Watchdog()
    with w.blocked("allreduce", group="node"):
        assert w.waiting[0] == "allreduce (group node)"
        assert w.overdue(-1.0, w.waiting[1] + 1.0).what == "allreduce (group node)"
        assert w.overdue(10.0, w.waiting[1] + 1.0) is None  # 1 s into a wait of at most 10: not overdue
        assert w.overdue(10.0, w.waiting[1] + 11.0).waited == pytest.approx(11.0)
    assert w.waiting is None and w.overdue(-1.0, 1e12) is None
    with pytest.raises(RuntimeError):
        with w.blocked("allgather"):
            assert w.waiting[0] == "allgather"
            raise RuntimeError("the collective failed")
    assert w.waiting is None


def test_a_watchdog_that_never_started_reports_nothing_and_stops():
    """An uncaught exception before the engine started its watchdog: the hook aborts as before.
    Break guarded: the watchdog's job unset until start (an AttributeError inside the exception hook)."""
    w = Watchdog()
    assert w.report_failure("RuntimeError: early", []) is False
    w.stop()


def test_stop_ends_the_watchdogs_thread():
    """Break guarded: the thread not leaving its poll when stopped (it would run on, and could call MPI after
    MPI is finalised at exit)."""
    before, w = watchdog_threads(), Watchdog()
    w.start(HangPolicy(timeout=None, floor=30.0, directory=None), 0, 2, lambda code: None, Recorder(), None)
    (thread,) = watchdog_threads() - before
    w.stop()
    thread.join(10.0)
    assert not thread.is_alive()


def test_the_abort_comes_a_grace_after_the_report():
    """Guards: MPI_Abort called at once after the report is printed (the launcher may kill the job before it
    forwards the report). A lower bound: a loaded machine only lengthens it."""
    from zerompi.comm.watchdog import _Job
    called = []
    job = _Job(HangPolicy(timeout=None, floor=1.0, directory=None), 0, 2,
               lambda code: called.append((code, time.monotonic())), Recorder(), None, threading.Event())
    start = time.monotonic()
    job.end(7)
    assert called and called[0][0] == 7 and called[0][1] - start >= watchdog.ABORT_GRACE


class _Posts:
    """A side channel that keeps what is posted (nothing arrives)."""

    def __init__(self):
        self.posted = []

    def post(self, dest, tag, obj):
        self.posted.append((dest, tag))

    def poll(self, tag):
        return []

    def flush(self):
        return True


def test_a_stopped_watchdog_reports_nothing():
    """An engine closed, or dropped after a lost rank (its channel may hold a dead rank, whose probes fail or
    wait): an uncaught exception afterwards aborts without the report. Break guarded: report_failure ignoring
    the stop (the 'too few survivors' job then asked a group with a dead rank for a report)."""
    w, channel = Watchdog(), _Posts()
    w.start(HangPolicy(timeout=None, floor=30.0, directory=None), 0, 2, lambda code: None, Recorder(), channel)
    w.stop()
    assert w.report_failure("ZeroMPIError: giving up", []) is False
    assert channel.posted == []


def test_the_exception_hook_aborts_when_the_report_fails(monkeypatch):
    """Break guarded: an error inside the report escaping the hook (Python then ends without MPI_Abort, and a
    job started as ``python script.py`` waits in MPI_Finalize for ranks that never come)."""
    import sys
    import types
    from zerompi.comm import guard

    class Failing:
        def report_failure(self, error, stack):
            raise RuntimeError("MPI_ERR_PROC_FAILED: Process Failure")
    aborted = []
    group = types.SimpleNamespace(rank=1, size=3, abort=aborted.append,
                                  monitor=types.SimpleNamespace(watchdog=Failing()))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(guard, "_group", None)
    monkeypatch.setattr(guard, "ABORT_GRACE", 0.0)
    guard.abort_on_uncaught_exception(group)
    try:
        raise ValueError("the job failed")
    except ValueError as e:
        sys.excepthook(type(e), e, e.__traceback__)
    assert aborted == [1]


def test_a_recovery_hands_the_hook_its_survivors_only_where_the_hook_is_installed(monkeypatch):
    """abort_on_exception=False installs no hook, and a recovery that gives up must not install one; where it is
    installed, it aborts the survivors' group (no dead rank in it) from then on."""
    import sys
    from zerompi.comm import guard
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(guard, "_group", None)
    before = sys.excepthook
    guard.hand_over(object())
    assert guard._group is None and sys.excepthook is before
    first, survivors = types_group(3), types_group(2)
    guard.abort_on_uncaught_exception(first)
    guard.hand_over(survivors)
    assert guard._group is survivors


def types_group(size):
    import types
    return types.SimpleNamespace(rank=0, size=size, abort=lambda code: None, monitor=None)
