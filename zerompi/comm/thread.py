"""A dedicated communication thread (``mpi_progress="thread"``).

MPI only advances a non-blocking collective inside an MPI call. With a
single thread, a collective started in backward therefore mostly runs when
backward ends and waits for it. Here one thread per process runs every
collective of the process as a *blocking* MPI call, in the order the main
thread issued them (so all ranks still meet at the same collectives): MPI
progresses inside that call while the main thread computes, since mpi4py
releases the GIL in MPI calls and torch releases it in its kernels.

This is Horovod's background-thread design reduced to one FIFO. It needs
``MPI_THREAD_MULTIPLE``: the main thread still makes local MPI calls
(ranks, communicators) and the checkpoint writer's MPI-IO, though never a
collective while the thread holds one. The thread itself knows nothing of
MPI; ``comm/mpi/group.py`` checks the thread level before starting it
(``thread_support_error``).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from zerompi.errors import ZeroMPIError


class CommThread:
    """Runs submitted calls one at a time, in submission order, on one daemon thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="zerompi-comm")
        self._closed = False
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` behind everything submitted before; its result arrives in the future."""
        if self._closed:
            raise ZeroMPIError("the communication thread was closed (engine.close())")
        future: Future = Future()
        self._queue.put((fn, future))
        return future

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` after everything queued before it and return its result (blocking)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
