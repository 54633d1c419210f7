"""The communication thread: issue order, results and errors, closing (zerompi/comm/thread.py)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from zerompi.errors import ZeroMPIError
from zerompi.comm.thread import CommThread


def test_calls_run_in_submission_order_on_one_other_thread():
    thread = CommThread()
    seen: list[tuple[int, str]] = []

    def call(i: int):
        time.sleep(0.01 if i % 2 else 0)  # an early slow call must not be overtaken
        seen.append((i, threading.current_thread().name))
        return i * i
    futures = [thread.submit(lambda i=i: call(i)) for i in range(6)]
    assert thread.run(lambda: "after") == "after"  # queued behind all six
    assert [f.result() for f in futures] == [i * i for i in range(6)]
    assert [i for i, _ in seen] == list(range(6))
    assert {name for _, name in seen} == {"zerompi-comm"}
    thread.close()


def test_an_error_reaches_the_waiter_and_the_thread_goes_on():
    thread = CommThread()

    def fail():
        raise ValueError("collective failed")
    bad = thread.submit(fail)
    with pytest.raises(ValueError, match="collective failed"):
        bad.result()
    assert thread.run(lambda: 7) == 7
    thread.close()


def test_close_finishes_the_queue_then_refuses():
    thread = CommThread()
    slow = thread.submit(lambda: time.sleep(0.05) or "done")
    thread.close()
    assert slow.result(timeout=0) == "done"
    with pytest.raises(ZeroMPIError, match="closed"):
        thread.submit(lambda: None)
    thread.close()  # idempotent


def test_run_from_the_thread_itself_does_not_deadlock():
    thread = CommThread()
    assert thread.run(lambda: thread.run(lambda: 3) + 1) == 4
    thread.close()


def test_thread_mode_without_thread_multiple_is_a_clear_error():
    """MPI initialised below MPI_THREAD_MULTIPLE: initialize names the setting instead of racing."""
    code = (
        "import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
        "import torch, zerompi\n"
        "try:\n"
        "    zerompi.initialize(torch.nn.Linear(2, 2), zerompi.ZeroConfig(mpi_progress='thread'))\n"
        "except zerompi.ZeroMPIError as e:\n"
        "    print('ERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERROR mpi_progress='thread' needs MPI_THREAD_MULTIPLE" in out.stdout, out.stdout + out.stderr
    assert "SERIALIZED" in out.stdout
