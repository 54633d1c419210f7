"""Hang protection: abort the job when this rank has waited too long in one collective.

A rank stuck in a collective (a peer died, or took another code path) would
otherwise hold the whole allocation until walltime. Every blocking wait of
every group of the process goes through :meth:`Watchdog.blocked`; a daemon
thread checks it a few times per timeout and, when overdue, prints what the
rank waits in and calls ``abort`` (``MPI_Abort`` in production).
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple

ABORT_GRACE = 0.5  # seconds between printing why the job aborts and MPI_Abort
ABORT_CODE = 3     # the exit code a watchdog abort gives the job


class Overdue(NamedTuple):
    """What this rank waits in, and for how long (seconds)."""

    what: str
    waited: float


class Watchdog:
    """What this process is blocked in, since when; and the thread that aborts when it is too long."""

    def __init__(self) -> None:
        self.waiting: tuple[str, float] | None = None  # (what, time.monotonic() when it started)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def blocked(self, what: str, group: str = "") -> Iterator[None]:
        """Record that this rank waits in ``what`` (on the group labelled ``group``, "" for one
        spanning the job) for the duration of the block."""
        self.waiting = (what + (f" (group {group})" if group else ""), time.monotonic())
        try:
            yield
        finally:
            self.waiting = None

    def overdue(self, timeout: float, now: float) -> Overdue | None:
        """The wait that has lasted longer than ``timeout`` seconds at ``now``, if any."""
        waiting = self.waiting
        if waiting is not None and now - waiting[1] > timeout:
            return Overdue(waiting[0], now - waiting[1])
        return None

    def start(self, timeout: float, rank: int, size: int, abort: Callable[[int], None]) -> None:
        """Start checking (once per process: later calls change nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, args=(timeout, rank, size, abort),
                                            daemon=True, name="zerompi-watchdog")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, timeout: float, rank: int, size: int, abort: Callable[[int], None]) -> None:
        while not self._stop.wait(min(1.0, timeout / 4)):
            late = self.overdue(timeout, time.monotonic())
            if late is not None:
                report = (f"zerompi watchdog: rank {rank} of {size} has waited {late.waited:.0f} s in "
                          f"{late.what} (collective_timeout={timeout:g} s); aborting the job\n")
                os.write(2, report.encode())
                time.sleep(ABORT_GRACE)  # let the launcher forward the report before it kills us
                abort(ABORT_CODE)
                return
