"""ShardFence: buckets a background save still reads may not change until it has them.

An asynchronous save returns before it has read the shards it writes. Instead of copying
them first, it *holds* every bucket, and :class:`FencedStore`, the layer through which the
optimizer reaches master and optimizer state, waits before it hands out bucket i for a
change (the step, a load); the save ``release(i)``-es each bucket once it has its own copy
of it (or has written it). So the save writes the state of the moment it was called, and
training waits only when it reaches a bucket the save has not yet taken (copy on write, at
bucket granularity). The optimizer does not know the fence: its store does.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager

import torch


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


class FencedStore:
    """An optimizer-state store (residency.py) whose accesses for a change wait at ``fence``: what a
    background save still reads is handed out only once the save has it. Readers (``frozen``,
    ``ahead``) pass straight through."""

    def __init__(self, inner, fence: ShardFence):
        self.inner, self.fence = inner, fence

    @property
    def streams(self) -> bool:
        return self.inner.streams

    def resident(self, index: int, *, load: bool = True) -> AbstractContextManager[None]:
        self.fence.wait(index)  # swapping it in and out rewrites the swap file's copy
        return self.inner.resident(index, load=load)

    def frozen(self, index: int) -> AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]]:
        return self.inner.frozen(index)

    def batches(self, indices: list[int] | None = None) -> Iterator[list[int]]:
        for batch in self.inner.batches(indices):
            for i in batch:
                self.fence.wait(i)  # a background save may still be taking this bucket
            yield batch

    def ahead(self, index: int) -> None:
        self.inner.ahead(index)

    def behind(self, index: int) -> AbstractContextManager[None]:
        self.fence.wait(index)
        return self.inner.behind(index)

    def drain(self) -> None:
        self.inner.drain()

    def close(self) -> None:
        self.inner.close()
