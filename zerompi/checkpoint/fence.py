"""ShardFence: buckets a background save still reads may not change until it has them.

An asynchronous save returns before it has read the shards it writes. Instead of copying
them first, it *holds* every bucket; the optimizer asks ``wait(i)`` before it changes
bucket i's master or optimizer state (the step, a load), and the save ``release(i)``-es
each bucket once it has its own copy of it (or has written it). So the save writes the
state of the moment it was called, and training waits only when it reaches a bucket the
save has not yet taken (copy on write, at bucket granularity).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable


class ShardFence:
    """Which buckets are held by an in-flight save; thread-safe."""

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._changed = threading.Condition()
        self.waits = 0           # times a caller had to wait (for benchmarks)
        self.waited_s = 0.0      # seconds callers waited in total

    def hold(self, indices: Iterable[int]) -> None:
        with self._changed:
            self._held.update(indices)

    def release(self, index: int) -> None:
        with self._changed:
            self._held.discard(index)
            self._changed.notify_all()

    def release_all(self) -> None:
        with self._changed:
            self._held.clear()
            self._changed.notify_all()

    def held(self, index: int) -> bool:
        with self._changed:
            return index in self._held

    def wait(self, index: int) -> None:
        """Return once bucket ``index`` may change (at once when no save holds it)."""
        with self._changed:
            if index not in self._held:
                return
            t0 = time.perf_counter()
            while index in self._held:
                self._changed.wait()
            self.waits += 1
            self.waited_s += time.perf_counter() - t0
