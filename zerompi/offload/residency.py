"""Where each bucket's fp32 master and optimizer state live between optimizer steps.

:class:`InMemory` keeps them where the bucket put them (the device, or host
memory for ``offload_optimizer='cpu'``). :class:`NVMeResidency` keeps them in
the rank's swap file: between steps their tensors exist as objects with
released storage (so the inner optimizer's state keys stay valid), and the
step streams buckets through memory, reading bucket i+1 and writing bucket
i-1 while bucket i is updated. At most three buckets' state is resident at a
time, whatever the model's size.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager

import torch

from zerompi.offload.aligned import aligned_empty, allocate, release
from zerompi.offload.nvme import NVMeSwapper


class InMemory:
    """Master and optimizer state stay in memory; nothing moves."""

    streams = False  # the state is in memory, not streamed from a file

    def __init__(self, buckets, inner: torch.optim.Optimizer):
        self.buckets, self.inner = buckets, inner

    @contextmanager
    def resident(self, index: int, *, load: bool = True) -> Iterator[None]:
        yield

    @contextmanager
    def frozen(self, index: int) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """For a reader on another thread: maps each of bucket ``index``'s tensors to a readable one
        (here the tensor itself, in memory)."""
        yield lambda t: t

    def batches(self) -> Iterator[list[int]]:
        """Bucket indices whose state is in memory together: here all of them at once."""
        yield list(range(len(self.buckets)))

    def close(self) -> None:
        pass


class NVMeResidency(InMemory):
    """Master and optimizer state in the swap file, streamed through memory bucket by bucket."""

    streams = True

    def __init__(self, buckets, inner: torch.optim.Optimizer, swapper: NVMeSwapper):
        super().__init__(buckets, inner)
        self.swapper = swapper
        self._numel: dict[str, int] = {}  # elements of each swapped tensor, while it is empty
        self._reads: dict[int, list[Future]] = {}
        self._writes: dict[int, list[Future]] = {}
        for i, b in enumerate(buckets):  # swap_out_master wrote each master as its bucket was built
            assert b.layout.index == i and not b.master.numel(), "masters are swapped out as buckets are built"
            self._numel[f"b{i}.master"] = swapper.region(f"b{i}.master").nbytes // b.master.element_size()

    @staticmethod
    def swap_out_master(swapper: NVMeSwapper, index: int, master: torch.Tensor) -> None:
        """Write bucket ``index``'s new master to the swap file and release it (before any step)."""
        key = f"b{index}.master"
        swapper.reserve(key, master.numel() * master.element_size())
        swapper.write(key, master).result()
        release(master)

    def _tensors(self, index: int) -> dict[str, torch.Tensor]:
        """The swapped tensors of a bucket: its master and per-element optimizer state."""
        master = self.buckets[index].master
        out = {f"b{index}.master": master}
        for k, v in self.inner.state.get(master, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # per-element state (not the step count)
                out[f"b{index}.state.{k}"] = v
        return out

    @contextmanager
    def frozen(self, index: int) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """Fresh copies of bucket ``index``'s tensors read from the swap file, whatever the step is
        doing with them meanwhile (the caller's fence keeps the file's copy unchanged); nothing is
        written back. Maps each tensor to its copy."""
        copies, reads = {}, []
        for key, t in self._tensors(index).items():
            if key in self._numel:  # swapped out at least once: the file has its latest values
                copies[id(t)] = aligned_empty(self._numel[key], t.dtype)
                reads.append(self.swapper.read(key, copies[id(t)]))
        for read in reads:
            read.result()
        yield lambda t: copies.get(id(t), t)

    def _fetch(self, index: int, load: bool = True) -> None:
        futures = []
        for key, t in self._tensors(index).items():
            if key in self._numel:
                allocate(t, self._numel[key])
                if load:
                    futures.append(self.swapper.read(key, t))
        self._reads[index] = futures

    def _ready(self, index: int) -> None:
        for f in self._reads.pop(index, []):
            f.result()  # raises SwapError naming the file, key and offset

    def _evict(self, index: int) -> None:
        futures = []
        for key, t in self._tensors(index).items():
            self.swapper.reserve(key, t.numel() * t.element_size())
            futures.append(self.swapper.write(key, t))
            self._numel[key] = t.numel()
        self._writes[index] = futures

    def _settle(self, index: int) -> None:
        futures = self._writes.pop(index, [])
        wait(futures)
        for f in futures:
            f.result()
        for t in self._tensors(index).values():
            release(t)

    @contextmanager
    def resident(self, index: int, *, load: bool = True) -> Iterator[None]:
        """Bucket ``index``'s state in memory for the block (``load=False``: about to be overwritten)."""
        self._fetch(index, load)
        self._ready(index)
        try:
            yield
        finally:
            self._evict(index)
            self._settle(index)

    def stream(self) -> Iterator[int]:
        """Yield each bucket index with its state resident; reads ahead one, writes behind one."""
        n = len(self.buckets)
        if n:
            self._fetch(0)
        for i in range(n):
            self._ready(i)
            if i + 1 < n:
                self._fetch(i + 1)
            yield i
            self._evict(i)
            if i > 0:
                self._settle(i - 1)
        if n:
            self._settle(n - 1)

    def batches(self) -> Iterator[list[int]]:
        """One bucket at a time, as it streams through memory."""
        for i in self.stream():
            yield [i]

    def close(self) -> None:
        self.swapper.close()
