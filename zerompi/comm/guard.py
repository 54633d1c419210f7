"""One failing rank ends the job: an uncaught exception is printed once and aborts MPI.

With the watchdog's side channel (watchdog.py), the rank first asks for the hang report, which
names it as the culprit with its exception and stack; rank 0 prints it and aborts the job.

Without this, the other ranks wait forever in their next collective, burning
the allocation until walltime. ``python -m mpi4py script.py`` does the same
for the whole script; this hook covers jobs started as ``python script.py``.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

from zerompi.comm.recorder import user_frames
from zerompi.comm.watchdog import ABORT_GRACE

_group = None  # the group the hook aborts: the latest one handed in (an engine's after the runner's)


def hand_over(group) -> None:
    """Where the hook is installed, it aborts ``group`` from now on (a recovery's survivors, whose group holds
    no dead rank); where it is not (``abort_on_exception=False``), nothing."""
    global _group
    if _group is not None:
        _group = group


def abort_on_uncaught_exception(group) -> None:
    """Install a ``sys.excepthook`` that reports the error with its rank and calls ``MPI_Abort``; a
    later call only hands it a newer group (an engine's, whose watchdog can add the hang report)."""
    global _group
    if group.size == 1:
        return
    first, _group = _group is None, group
    if not first:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        group = _group
        if issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.stderr.flush()
        os.write(2, (f"zerompi: rank {group.rank} of {group.size} failed with an uncaught "
                     f"{kind.__name__}: {value}\n{text}zerompi: aborting all ranks\n").encode())
        watchdog = getattr(getattr(group, "monitor", None), "watchdog", None)
        if watchdog is not None:  # rank 0 adds the hang report and aborts the job (watchdog.py)
            first_line = next(iter(str(value).splitlines()), "")
            try:
                watchdog.report_failure(f"{kind.__name__}: {first_line}", user_frames(traceback.extract_tb(tb)))
            except Exception as e:  # noqa: BLE001 - a failing report must not keep the job from its abort
                os.write(2, f"zerompi: rank {group.rank}: the hang report failed ({e}); aborting without it\n".encode())
        time.sleep(ABORT_GRACE)  # let the launcher forward the report before it kills the job
        group.abort(1)

    sys.excepthook = hook
