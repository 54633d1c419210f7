"""Asynchronous save: the shards are written, fsynced and published on a thread that makes no MPI call.

``engine.save_checkpoint(..., async_save=True)`` does its collective part on the calling thread
(agreeing on the tag and the save's id, cleaning the root, making ``ROOT/.tmp-TAG-ID``, reading
the counters, RNG state, error-feedback residuals, whole-tensor optimizer state, optimizer metadata
and, on rank 0, the index with client_state and the scheduler's state and the replicated tensors, all
as copies), holds every bucket in the engine's :class:`~zerompi.offload.fence.ShardFence`, starts one
thread per writing rank and returns. The thread gets only what was taken at the call (taken.py:
host copies, the fenced buckets, the frozen shards). It takes each bucket (a copy in host memory, or,
under NVMe offload, a read of the swap file, which the fence keeps unchanged until then), releases it,
and writes the rank file as a synchronous save does (rawio.py: checksums as written, fsync).

Completion without MPI (a thread blocked in MPICH busy-polls a core, and MPI_THREAD_MULTIPLE is not
everywhere): each writing rank's thread ends by putting a marker in the temporary directory,
``.done-rankNNNNN``, empty on success or holding the error, written to a temporary name and renamed
(atomic on POSIX and shared filesystems; the rank file was fsynced before, so a marker seen means
the file is durable). Rank 0's thread then waits for every writer's marker and, if all succeeded,
removes them, writes and checks ``index.h5`` and publishes (rename of the directory, then of
``latest``) exactly as the synchronous save does: ``latest`` moves only when the tag is complete, and
a job killed at any moment leaves the previous ``latest`` loadable.

Reporting is collective and on the caller's thread: ``engine.wait_checkpoint()`` (called before the
next save or load, and by ``close()``) waits for this rank's file, agrees with all_ranks_ok on every
writer's outcome (so rank 0's thread stops waiting for markers that will never come), waits for the
publication and raises CheckpointError on every rank if anything failed. At interpreter exit the
thread (not a daemon) is joined before Python finalizes: the save completes, and a failure is
logged, since no collective is possible there.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from zerompi.offload.fence import ShardFence
from zerompi.checkpoint.writer import discard
from zerompi.comm.group import ProcessGroup
from zerompi.log import get_logger

logger = get_logger(__name__)
POLL_S = (0.002, 0.05)  # rank 0's marker polling: first and longest interval


def marker(directory: Path, rank: int) -> Path:
    return directory / f".done-rank{rank:05d}"


def _put_marker(directory: Path, rank: int, error: str | None) -> None:
    path = marker(directory, rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(error or "")
    tmp.rename(path)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class BackgroundSave:
    """One asynchronous save in flight on this rank.

    Args:
        tag: the checkpoint's tag.
        directory: the save's temporary directory (every rank's marker goes there).
        write: writes this rank's file (None: this rank writes none, an hsdp replica).
        rank: this rank's writer number (its rank in the shard group); writers: how many write.
        publish: rank 0 only: writes the index and publishes, once every writer succeeded.
        fence: released entirely when the thread ends, whatever happened.
    """

    def __init__(self, tag: str, directory: Path, write: Callable[[], None] | None, rank: int, writers: int,
                 publish: Callable[[], None] | None, fence: ShardFence):
        self.tag, self.directory, self.rank, self.writers = tag, directory, rank, writers
        self._write, self._publish, self._fence = write, publish, fence
        self._written = threading.Event()  # this rank's file is done (or failed): local_error is final
        self._agreed = threading.Event()   # wait() has the writers' outcome: rank 0 stops polling markers
        self._outcome: list[str] = []      # the writers' errors, as agreed
        self.local_error: str | None = None
        self.publish_error: str | None = None
        self.seconds: dict[str, float] = {}  # write / publish wall times (benchmarks)
        self._thread = threading.Thread(target=self._run, name=f"zerompi-save-{tag}", daemon=False)

    def start(self) -> "BackgroundSave":
        self._thread.start()
        return self

    # ---- the thread --------------------------------------------------------
    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._write is not None:
                self._write()
        except Exception as e:  # noqa: BLE001 - every failure is reported through wait()
            self.local_error = _describe(e)
        finally:
            self._fence.release_all()
        if self._write is not None:
            try:
                _put_marker(self.directory, self.rank, self.local_error)
            except OSError as e:
                self.local_error = self.local_error or f"cannot write the completion marker ({_describe(e)})"
        self.seconds["write"] = time.perf_counter() - t0
        self._written.set()
        if self._publish is not None:
            self._publish_when_written()
        if self.local_error or self.publish_error:
            logger.error("asynchronous save of %s failed: %s", self.tag, self.local_error or self.publish_error)

    def _publish_when_written(self) -> None:
        t0 = time.perf_counter()
        failures = self._wait_for_writers()
        if failures:
            self.publish_error = "not published: " + "; ".join(failures)
            return
        try:
            for r in range(self.writers):
                marker(self.directory, r).unlink(missing_ok=True)
            self._publish()
        except Exception as e:  # noqa: BLE001
            self.publish_error = _describe(e)
        self.seconds["publish"] = time.perf_counter() - t0

    def _wait_for_writers(self) -> list[str]:
        """Each failed writer's error once every writer's marker is there (or wait() has agreed)."""
        pause, seen = POLL_S[0], {}
        while True:
            for r in range(self.writers):
                path = marker(self.directory, r)
                if r not in seen and path.exists():
                    seen[r] = path.read_text()
            failures = [f"rank {r}: {e}" for r, e in sorted(seen.items()) if e]
            if failures or len(seen) == self.writers:
                return failures
            if self._agreed.wait(pause):
                return list(self._outcome)
            pause = min(2 * pause, POLL_S[1])

    # ---- the caller's thread -------------------------------------------------
    def wait(self, group: ProcessGroup) -> None:
        """Collective: wait for the save; CheckpointError on every rank if it failed anywhere."""
        self._written.wait()
        try:
            errors = group.allgather_object(self.local_error)
        except BaseException as e:  # a peer is gone: rank 0's thread must not wait for its marker forever
            self.abandon(f"the writers' outcome could not be agreed ({_describe(e)})")
            raise
        self._outcome = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        self._agreed.set()
        self._thread.join()
        failed = "; ".join(self._outcome) or group.allgather_object(self.publish_error)[0]
        if failed:  # the same on every rank: every rank raises; rank 0 removes the partial files first
            raise discard(f"asynchronous save of {self.tag!r}", failed, self.directory, remove=self._publish is not None)

    def abandon(self, reason: str) -> None:
        """Without MPI (a peer is gone): give up on the other writers, so that rank 0's thread stops waiting
        for their markers and publishes nothing; this rank's own write still finishes on its thread."""
        self._outcome = [reason]
        self._agreed.set()

    def join(self, timeout: float | None = None) -> bool:
        """Without MPI: wait for this rank's thread (rank 0's publishes when every marker is there)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()
