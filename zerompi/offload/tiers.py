"""Where a bucket's shards live between uses: a tier per shard, chosen once, handed in at build.

A bucket keeps three flat shards that offload may move: its compute-dtype
parameter shard, its gradient shard and its fp32 master. :class:`TierPlan` is
the one place that reads the offload settings; a bucket asks it, while it is
being built, for the tier of each shard, and never learns which tier it got
beyond what :class:`ShardTier` says:

* :class:`Resident` keeps the tensor in device or host memory;
* :class:`Swapped` keeps it in the rank's swap file and reads it back for the
  duration of a ``loaded()`` block (``stays_resident`` is False, so a bucket
  must finish any collective on it inside the block);
* :class:`MasterAlias`, an fp32 parameter shard whose master is swapped too,
  reads the master's region instead of keeping a copy.

The master and the optimizer state stream through memory during the step
(``residency.py``); :meth:`TierPlan.optimizer_store` chooses how.
A new tier is one class here and a branch in :class:`TierPlan`.
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from zerompi.blockio.aligned import Reuse, aligned_empty, allocate, release
from zerompi.config.choices import Offload
from zerompi.offload.fence import FencedStore, ShardFence
from zerompi.offload.nvme import NVMeSwapper
from zerompi.offload.residency import InMemory, NVMeResidency


class ShardTier(Protocol):
    """Where one flat shard lives between uses."""

    stays_resident: bool
    """The tensor ``loaded()`` yields stays valid after the block (a collective may outlive it)."""

    reads_master: bool
    """The shard is read from the master's swap region, so publishing the master into it moves nothing."""

    memory: Reuse | None
    """Where memory this tier releases waits for the next tensor of its size (its swapper's pool), or None."""

    def loaded(self, *, load: bool = True) -> AbstractContextManager[torch.Tensor]:
        """The shard in memory for the block (``load=False``: it is about to be overwritten)."""

    def store(self) -> None:
        """Inside ``loaded()``: persist what the block changed."""

    def snapshot(self) -> AbstractContextManager[torch.Tensor]:
        """The shard's values for a reader that may run on another thread (a background save):
        nothing the training thread uses is touched (a swapped shard is read into a private buffer)."""

    def prefetch(self) -> None:
        """Start bringing the shard into memory, so that the next ``loaded()`` waits less."""

    @property
    def nbytes(self) -> int:
        """Bytes held in memory now."""


class Resident:
    """A shard kept in memory (the device's, or the host's for 'cpu' offload)."""

    stays_resident = True
    reads_master = False
    memory = None

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @contextmanager
    def loaded(self, *, load: bool = True) -> Iterator[torch.Tensor]:
        yield self.tensor

    @contextmanager
    def snapshot(self) -> Iterator[torch.Tensor]:
        yield self.tensor

    def store(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class Swapped:
    """A shard in the swap file between uses: a bucket's parameter shard (stage 3,
    ``offload_params='nvme'``) or its gradient shard (stages 2-3, ``offload_optimizer='nvme'``).
    Built from the resident shard, which it writes out and releases at once."""

    stays_resident = False
    reads_master = False

    @property
    def memory(self) -> Reuse:
        return self.swapper.memory

    def __init__(self, swapper: NVMeSwapper, key: str, shard: torch.Tensor):
        self.swapper, self.key, self.shard, self.numel = swapper, key, shard, shard.numel()
        self._read: Future | None = None  # a read-ahead in flight (prefetch)
        self.read_ahead = 0  # reads started by prefetch(), for tests and benchmarks
        self.store()

    def store(self) -> None:
        """Write the (resident) shard out and release it."""
        self.swapper.reserve(self.key, self.shard.numel() * self.shard.element_size())
        self.swapper.write(self.key, self.shard).result()
        release(self.shard, self.memory)

    def prefetch(self) -> None:
        if self._read is None and not self.shard.numel():
            allocate(self.shard, self.numel, self.memory)
            self._read = self.swapper.read(self.key, self.shard)
            self.read_ahead += 1

    @contextmanager
    def loaded(self, *, load: bool = True) -> Iterator[torch.Tensor]:
        if self._read is not None:  # read ahead: wait for it (also before overwriting the tensor)
            read, self._read = self._read, None
            read.result()
        else:
            allocate(self.shard, self.numel, self.memory)
            if load:
                self.swapper.read(self.key, self.shard).result()
        try:
            yield self.shard
        finally:
            if self.shard.numel():
                release(self.shard, self.memory)

    @contextmanager
    def snapshot(self) -> Iterator[torch.Tensor]:
        copy = aligned_empty(self.numel, self.shard.dtype, self.memory)
        self.swapper.read(self.key, copy).result()
        yield copy

    @property
    def nbytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()


class MasterAlias(Swapped):
    """An fp32 parameter shard whose fp32 master is in the swap file too: after every step both hold
    the same values, so the shard is read from the master's region and never written (the step writes
    the master): 4 bytes per element per step less traffic, and no region of its own. The master is
    written to the swap file as the bucket is built (TierPlan.place_master), from the same values."""

    reads_master = True

    def __init__(self, swapper: NVMeSwapper, index: int, shard: torch.Tensor):  # noqa: D107 - no write here
        self.swapper, self.key, self.shard, self.numel = swapper, f"b{index}.master", shard, shard.numel()
        self._read: Future | None = None
        self.read_ahead = 0
        release(self.shard, self.memory)

    def store(self) -> None:
        """Nothing to write: the master's region, which the step writes, holds these values."""


@dataclass(frozen=True)
class TierPlan:
    """Where new buckets' shards go, from the offload settings (read here and nowhere else).

    Args:
        optimizer: ``offload_optimizer``: where master weights and optimizer state live.
        params: ``offload_params``: where stage 3's parameter shards live.
        device: the compute device.
        shard_grads: gradients are sharded (stages 2-3): with 'nvme' optimizer offload their
            shards go to the swap file too, as in ZeRO-Infinity.
        swapper: the rank's swap file, when anything goes to 'nvme'.
        pin_memory: pin host copies when there is a GPU to copy to.
        fence: what asynchronous saves hold; the optimizer's store waits at it (fence.py).
    """

    optimizer: Offload = Offload.NONE
    params: Offload = Offload.NONE
    device: torch.device = torch.device("cpu")
    shard_grads: bool = False
    swapper: NVMeSwapper | None = None
    pin_memory: bool = False
    fence: ShardFence = field(default_factory=ShardFence)

    @property
    def moves_state(self) -> bool:
        """A parameter shard or master leaves device memory. On a CPU device, 'cpu' offload has
        nowhere to move them: they are in host memory already."""
        moved = {self.optimizer, self.params} - {Offload.NONE}
        if self.device.type == "cpu":
            moved.discard(Offload.CPU)
        return bool(moved)

    @property
    def reuse(self) -> Reuse | None:
        """Where stage 3's released gather and gradient buffers wait for the next of their size:
        the pool of released host memory (aligned.py's Reuse) when shards stream through a swap
        file, which is where fresh memory's page faults cost the step most."""
        return self.swapper.memory if self.swapper is not None else None

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A host-memory copy of ``t`` (pinned when there is a GPU to copy to)."""
        out = t.detach().to("cpu", copy=True)
        return out.pin_memory() if self.pin_memory and torch.cuda.is_available() else out

    def off_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where a swap file can read and write it: host memory (a CPU tensor stays as it is)."""
        return self.host(t) if t.device.type != "cpu" else t

    def param_tier(self, index: int, shard: torch.Tensor, tier: Offload, *, frozen: bool = False) -> ShardTier:
        """Bucket ``index``'s parameter shard (stage 3) in ``tier``, its parameters' record's
        (shard/placement.py); frozen buckets are numbered apart (and have no master to share a region with)."""
        if not frozen and tier == Offload.NVME and self.optimizer == Offload.NVME and shard.dtype == torch.float32:
            return MasterAlias(self.swapper, index, self.off_device(shard))  # fp32: the master's values, in its region
        if tier == Offload.NVME:
            return Swapped(self.swapper, f"{'f' if frozen else 'b'}{index}.param", self.host(shard))
        return Resident(self.host(shard) if tier == Offload.CPU else shard)

    def grad_tier(self, index: int, shard: torch.Tensor) -> ShardTier:
        """Bucket ``index``'s gradient shard."""
        if self.optimizer == Offload.NVME and self.shard_grads:  # swap files take host memory only
            return Swapped(self.swapper, f"b{index}.grad", self.off_device(shard))
        return Resident(shard)

    def place_master(self, index: int, master: torch.Tensor, separate: bool) -> torch.Tensor:
        """Bucket ``index``'s fp32 master, where the optimizer state will live. With 'nvme' it is
        written to the swap file before the next bucket exists, so that building the model holds
        one bucket's state, not the model's."""
        if self.optimizer == Offload.NONE or not separate:
            return master
        master = self.host(master)
        if self.optimizer == Offload.NVME:
            NVMeResidency.swap_out_master(self.swapper, index, master)
        return master

    def optimizer_store(self, buckets, inner: torch.optim.Optimizer) -> FencedStore:
        """How master and optimizer state come into memory for the step, behind the fence of
        asynchronous saves (fence.py)."""
        store = NVMeResidency(buckets, inner, self.swapper) if self.optimizer == Offload.NVME else \
            InMemory(buckets, inner)
        return FencedStore(store, self.fence)
