"""A flight recorder of this process's collectives, always on, for naming the culprit of a hang.

Every collective of every group of the process (and every barrier and metadata exchange) appends
one :class:`Event` to a fixed-size ring: its number in the recorder, kind, group, what it is for
(bucket, module), bytes, and when it started and ended. Appending costs a small object and a
``deque.append``; nothing else runs per collective. The Python stack of the training thread is
taken only when a hang is diagnosed (:func:`user_stack`), from ``sys._current_frames()``.

The engine calls :meth:`Recorder.step_done` at the end of each optimizer step; the running median
of step times sets the default deadline of the watchdog (watchdog.py).

:meth:`Recorder.snapshot` turns the ring into a plain dict (JSON and pickle friendly): the
per-rank record that diagnosis.py compares across ranks and that is written to a file on abort.
"""
from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

RING = 256         # events kept per process
STEP_WINDOW = 32   # step durations kept for the running median
STACK_FRAMES = 8   # innermost user frames kept in a record
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../zerompi
_LIBRARY_PARTS = (os.sep + "torch" + os.sep, os.sep + "mpi4py" + os.sep, os.sep + "threading.py",
                  os.sep + "concurrent" + os.sep, os.sep + "contextlib.py")


class Event:
    """One collective (or barrier) as this rank issued it; ``end`` is None while it is in flight."""

    __slots__ = ("index", "kind", "group", "what", "nbytes", "start", "end", "step")

    def __init__(self, index: int, kind: str, group: str, what: str, nbytes: int, start: float, step: int):
        self.index, self.kind, self.group, self.what = index, kind, group, what
        self.nbytes, self.start, self.end, self.step = nbytes, start, None, step

    def signature(self) -> tuple[str, str, str, int]:
        """What every rank's event at the same index must agree on."""
        return (self.kind, self.group, self.what, self.nbytes)


class Recorder:
    """The ring of this process's last :data:`RING` events, step times, and the training thread."""

    def __init__(self, size: int = RING) -> None:
        self.events: deque[Event] = deque(maxlen=size)
        self.count = 0                              # events recorded so far (the next event's index)
        self.steps = 0                              # optimizer steps ended so far
        self._step_times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._last_step = time.monotonic()
        self.thread = threading.get_ident()         # the thread whose stack a diagnosis shows

    def begin(self, kind: str, group: str, what: str, nbytes: int) -> Event:
        """Record that this rank issues a collective; the caller sets ``event.end`` when it completes."""
        event = Event(self.count, kind, group, what, nbytes, time.monotonic(), self.steps)
        self.count += 1
        self.events.append(event)
        return event

    def step_done(self) -> None:
        """An optimizer step ended: its duration feeds the running median."""
        now = time.monotonic()
        self._step_times.append(now - self._last_step)
        self._last_step = now
        self.steps += 1

    def median_step(self) -> float | None:
        """The median of the last steps' durations (seconds), None before the second step ends.

        The first step carries warm-up (allocation, the recorded prefetch order), so it is left out
        once others exist."""
        times = list(self._step_times)
        if len(times) < 2:
            return None
        return statistics.median(times[1:] if len(times) > 2 else times)

    def snapshot(self, rank: int, size: int, waiting: tuple | None, reason: str) -> dict[str, Any]:
        """This rank's record: the ring, what it waits in (if anything) and the training thread's stack.

        ``waiting`` is the watchdog's ``(what, since, event number or None)``; times become ages in seconds before now, so
        records of different processes compare without a common clock."""
        now = time.monotonic()
        events = [[e.index, e.kind, e.group, e.what, e.nbytes, round(now - e.start, 3),
                   None if e.end is None else round(now - e.end, 3), e.step] for e in list(self.events)]
        return {
            "rank": rank, "size": size, "host": socket.gethostname(), "pid": os.getpid(),
            "wall_time": time.time(), "reason": reason, "steps": self.steps,
            "median_step": self.median_step(), "count": self.count, "events": events,
            "waiting": None if waiting is None else waiting[0],
            "waited": None if waiting is None else round(now - waiting[1], 3),
            "waiting_event": None if waiting is None or len(waiting) < 3 else waiting[2],
            "stack": user_stack(self.thread),
        }


def _is_library(filename: str) -> bool:
    return (filename.startswith(_PACKAGE) or filename.startswith("<frozen")
            or any(part in filename for part in _LIBRARY_PARTS))


def user_stack(thread: int, limit: int = STACK_FRAMES) -> list[str]:
    """The innermost ``limit`` frames of ``thread`` outside zerompi, torch, mpi4py and the standard
    thread machinery, outermost first, as ``file:line in function: source``; then the innermost
    library frame, if the thread is inside one (``[in library] ...``). Empty if the thread has ended."""
    frame = sys._current_frames().get(thread)
    return [] if frame is None else user_frames(traceback.extract_stack(frame), limit)


def user_frames(frames: traceback.StackSummary, limit: int = STACK_FRAMES) -> list[str]:
    """:func:`user_stack` of a stack already extracted (e.g. an exception's traceback)."""
    user = [f for f in frames if not _is_library(f.filename)]
    lines = [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in user[-limit:]]
    if frames and _is_library(frames[-1].filename):
        inner = frames[-1]
        lines.append(f"[in library] {inner.filename}:{inner.lineno} in {inner.name}")
    return lines
