"""Where each bucket's fp32 master and optimizer state live between optimizer steps.

:class:`InMemory` keeps them where the bucket put them (the device, or host
memory for ``offload_optimizer='cpu'``). :class:`NVMeResidency` keeps them in
the rank's swap file: between steps their tensors exist as objects with
released storage (so the inner optimizer's state keys stay valid), and the
step streams buckets through memory, reading bucket i+1 and writing bucket
i-1 while bucket i is updated. At most three buckets' state is resident at a
time, whatever the model's size. With ``optimizer_in_backward`` the buckets come
in backward's order instead: ``ahead`` starts a bucket's reads when its unit's
backward begins, ``behind`` updates it once its gradient is reduced and leaves
its writes in flight (``BEHIND`` buckets at most), ``drain`` ends the step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from zerompi.blockio.aligned import aligned_empty, allocate, release
from zerompi.offload.nvme import NVMeSwapper, Priority


class ShardState(NamedTuple):
    """A bucket's fp32 master and its optimizer state, in memory for the duration of a block."""

    master: torch.Tensor
    state: dict[str, Any]  # per-element tensors and scalars, as the inner optimizer keeps them


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

    def batches(self, indices: list[int] | None = None) -> Iterator[list[int]]:
        """Bucket indices (``indices``, default all) whose state is in memory together: here all
        of them at once."""
        order = list(range(len(self.buckets))) if indices is None else list(indices)
        if order:
            yield order

    # -- one bucket at a time, while backward computes (optimizer_in_backward) --
    def ahead(self, index: int) -> None:
        """Start bringing bucket ``index``'s state into memory for a coming ``behind()``."""

    @contextmanager
    def behind(self, index: int) -> Iterator[None]:
        """Bucket ``index``'s state in memory for the block; what the block changed is written
        back behind it, while the caller goes on (``drain()`` waits for it)."""
        yield

    def drain(self) -> None:
        """Wait for every write ``behind()`` left in flight."""

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
        self._behind: list[int] = []  # buckets behind() left writing, oldest first
        for i, b in enumerate(buckets):  # swap_out_master wrote each master as its bucket was built
            assert b.layout.index == i and not b.master.numel(), "masters are swapped out as buckets are built"
            self._numel[f"b{i}.master"] = swapper.region(f"b{i}.master").nbytes // b.master.element_size()

    @staticmethod
    def swap_out_master(swapper: NVMeSwapper, index: int, master: torch.Tensor) -> None:
        """Write bucket ``index``'s new master to the swap file and release it (before any step)."""
        key = f"b{index}.master"
        swapper.reserve(key, master.numel() * master.element_size())
        swapper.write(key, master).result()
        release(master, swapper.memory)

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
                copies[id(t)] = aligned_empty(self._numel[key], t.dtype, self.swapper.memory)
                reads.append(self.swapper.read(key, copies[id(t)]))
        for read in reads:
            read.result()
        yield lambda t: copies.get(id(t), t)

    def _fetch(self, index: int, load: bool = True) -> None:
        futures = []
        for key, t in self._tensors(index).items():
            if key in self._numel:
                allocate(t, self._numel[key], self.swapper.memory)
                if load:  # after the parameter reads the compute thread is about to wait on
                    futures.append(self.swapper.read(key, t, Priority.SOON))
        self._reads[index] = futures

    def _ready(self, index: int) -> None:
        for f in self._reads.pop(index, []):
            f.result()  # raises SwapError naming the file, key and offset

    def _evict(self, index: int) -> None:
        futures = []
        for key, t in self._tensors(index).items():
            self.swapper.reserve(key, t.numel() * t.element_size())
            futures.append(self.swapper.write(key, t, Priority.BEHIND))
            self._numel[key] = t.numel()
        self._writes[index] = futures

    def _settle(self, index: int) -> None:
        futures = self._writes.pop(index, [])
        wait(futures)
        for f in futures:
            f.result()
        for t in self._tensors(index).values():
            release(t, self.swapper.memory)

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

    def stream(self, indices: list[int] | None = None) -> Iterator[int]:
        """Yield each bucket index (``indices``, default all) with its state resident; reads ahead
        one, writes behind one."""
        order = list(range(len(self.buckets))) if indices is None else list(indices)
        if order:
            self._fetch(order[0])
        for k, i in enumerate(order):
            self._ready(i)
            if k + 1 < len(order):
                self._fetch(order[k + 1])
            yield i
            self._evict(i)
            if k > 0:
                self._settle(order[k - 1])
        if order:
            self._settle(order[-1])

    def batches(self, indices: list[int] | None = None) -> Iterator[list[int]]:
        """One bucket at a time, as it streams through memory."""
        for i in self.stream(indices):
            yield [i]

    BEHIND = 2
    """Buckets whose writes ``behind()`` leaves in flight before it waits for the oldest."""

    def ahead(self, index: int) -> None:
        if index not in self._reads and index not in self._behind:
            self._fetch(index)

    @contextmanager
    def behind(self, index: int) -> Iterator[None]:
        if index in self._behind:  # still being written: the file is current once that lands
            self._behind.remove(index)
            self._settle(index)
        if index not in self._reads:
            self._fetch(index)
        self._ready(index)
        yield
        self._evict(index)
        self._behind.append(index)
        self._settle_behind(self.BEHIND)

    def drain(self) -> None:
        self._settle_behind(0)

    def _settle_behind(self, keep: int) -> None:
        """Wait for the oldest writes ``behind()`` left until at most ``keep`` buckets' remain."""
        while len(self._behind) > keep:
            self._settle(self._behind.pop(0))

    def close(self) -> None:
        self.swapper.close()
