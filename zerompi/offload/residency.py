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

from collections.abc import Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager

import torch

from zerompi.offload.aligned import aligned_empty
from zerompi.offload.nvme import NVMeSwapper


def _free(t: torch.Tensor) -> None:
    # Swap the tensor's data for an empty one: the object (an optimizer state key) survives, and
    # the old storage goes once the swapper's finished transfer drops its view of it.
    t.data = t.new_empty(0)


def _alloc(t: torch.Tensor, numel: int) -> None:
    # Host memory on a 4 KiB boundary: the swapper moves it with O_DIRECT, no staging copy
    # (pinned memory is page aligned already).
    if t.numel() != numel:
        t.data = aligned_empty(numel, t.dtype) if t.device.type == "cpu" and not t.is_pinned() \
            else t.new_empty(numel)


class InMemory:
    """Master and optimizer state stay in memory; nothing moves."""

    streaming = False

    def __init__(self, buckets, inner: torch.optim.Optimizer):
        self.buckets, self.inner = buckets, inner

    @contextmanager
    def resident(self, index: int, *, load: bool = True) -> Iterator[None]:
        yield

    def stream(self) -> Iterator[int]:
        yield from range(len(self.buckets))

    def close(self) -> None:
        pass


class NVMeResidency(InMemory):
    """Master and optimizer state in the swap file, streamed through memory bucket by bucket."""

    streaming = True

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
    def swap_out_master(swapper: NVMeSwapper, bucket) -> None:
        """Write a new bucket's master to the swap file and release it (before any step)."""
        key, master = f"b{bucket.layout.index}.master", bucket.master
        swapper.reserve(key, master.numel() * master.element_size())
        swapper.write(key, master).result()
        _free(master)

    def _tensors(self, index: int) -> dict[str, torch.Tensor]:
        """The swapped tensors of a bucket: its master and per-element optimizer state."""
        master = self.buckets[index].master
        out = {f"b{index}.master": master}
        for k, v in self.inner.state.get(master, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # per-element state (not the step count)
                out[f"b{index}.state.{k}"] = v
        return out

    def _fetch(self, index: int, load: bool = True) -> None:
        futures = []
        for key, t in self._tensors(index).items():
            if key in self._numel:
                _alloc(t, self._numel[key])
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
            _free(t)

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

    def close(self) -> None:
        self.swapper.close()


class ParamSwap:
    """A shard that lives in the swap file between uses: a bucket's parameter shard (stage 3
    ``offload_params='nvme'``) or its gradient shard (stages 2-3 ``offload_optimizer='nvme'``)."""

    def __init__(self, swapper: NVMeSwapper, key: str, shard: torch.Tensor):
        self.swapper, self.key, self.shard, self.numel = swapper, key, shard, shard.numel()
        self._read: Future | None = None  # a read-ahead in flight (prefetch)
        self.read_ahead = 0  # reads started by prefetch(), for tests and benchmarks
        self.store()

    def store(self) -> None:
        """Write the (resident) shard out and release it."""
        self.swapper.reserve(self.key, self.shard.numel() * self.shard.element_size())
        self.swapper.write(self.key, self.shard).result()
        _free(self.shard)

    def prefetch(self) -> None:
        """Start reading the shard back without waiting: the next ``loaded()`` finds it in memory."""
        if self._read is None and not self.shard.numel():
            _alloc(self.shard, self.numel)
            self._read = self.swapper.read(self.key, self.shard)
            self.read_ahead += 1

    @contextmanager
    def loaded(self, *, load: bool = True) -> Iterator[torch.Tensor]:
        """The shard in memory for the block; released afterwards (``store()`` persists changes)."""
        if self._read is not None:  # read ahead: wait for it (also before overwriting the tensor)
            read, self._read = self._read, None
            read.result()
        else:
            _alloc(self.shard, self.numel)
            if load:
                self.swapper.read(self.key, self.shard).result()
        try:
            yield self.shard
        finally:
            if self.shard.numel():
                _free(self.shard)
