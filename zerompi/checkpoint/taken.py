"""What an asynchronous save hands its thread: records taken on the caller's thread, typed so that the
thread cannot read anything a later step changes.

``save_checkpoint(async_save=True)`` returns while its thread writes, and the next steps change the
optimizer's state, the residuals and the RNG in place. So the thread receives no entry, tensor or
closure, only what each entry's ``take()`` (snapshot.py) returns at the call, one of three types:

- :class:`HostCopy`: datasets as host arrays of numpy's own memory (no view of a tensor), read-only,
  copied at the call; every entry's except the two below;
- :class:`~zerompi.checkpoint.shards.FencedBuckets`: the optimizer's buckets, which the engine's fence
  holds from the call until the thread has each (a step waits for a bucket still held); a bucket found
  released is refused. Copying them all at the call instead would double the optimizer's memory;
- :class:`~zerompi.checkpoint.frozen.FrozenRead`: stage 3's frozen shards, which no step changes (a load
  does, and waits for the save first).

:class:`Capture`, what the thread writes, and :func:`check_plain`, for what rank 0 publishes, refuse
anything else by type, on the caller's thread, before the thread starts: CheckpointError at the call.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerompi.checkpoint.frozen import FrozenRead
from zerompi.checkpoint.shards import FencedBuckets
from zerompi.checkpoint.snapshot import Entry, Taken
from zerompi.errors import CheckpointError

Part = tuple[str, np.ndarray]


def owns_memory(a: np.ndarray) -> bool:
    """Whether ``a``'s memory is numpy's own, not a tensor's (``Tensor.numpy()`` views the tensor)."""
    while a.base is not None:
        if not isinstance(a.base, np.ndarray):
            return False
        a = a.base
    return a.flags.owndata


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A host array of numpy's own memory with ``t``'s values, as ``shards.to_numpy`` gives them (16-bit
    floats widened to fp32, exactly): one copy, from any device."""
    wide = torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype
    out = np.empty(tuple(t.shape), dtype=torch.empty(0, dtype=wide).numpy().dtype)
    torch.from_numpy(out).copy_(t.detach())
    return out


def _tuple(value: Any, what: str) -> None:
    if type(value) is not tuple:
        raise CheckpointError(f"{what} must be a tuple, not {type(value).__name__} (read after the call returns)")


def _frozen_array(a: Any, what: str) -> np.ndarray:
    """``a``, made read-only, if it is an array of numpy's own memory; CheckpointError otherwise."""
    if not (isinstance(a, np.ndarray) and owns_memory(a)):
        kind = "a view of a tensor's memory" if isinstance(a, np.ndarray) else type(a).__name__
        raise CheckpointError(f"an asynchronous save would write {what} from {kind} after the call returns; "
                              "its thread takes host arrays of their own memory (HostCopy.of copies them)")
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class HostCopy:
    """Datasets taken at the call, as host arrays of numpy's own memory, made read-only."""

    datasets: tuple[Part, ...]

    def __post_init__(self):
        _tuple(self.datasets, "a host copy's datasets")  # a generator would be spent by the check itself
        for name, data in self.datasets:
            _frozen_array(data, f"dataset {name!r}")

    @classmethod
    def of(cls, parts: Iterable[Part]) -> HostCopy:
        """Copies of ``parts``, now (an array may view a tensor, or be one the engine keeps)."""
        return cls(tuple((name, np.array(data, copy=True)) for name, data in parts))

    def parts(self) -> Iterator[Part]:
        return iter(self.datasets)


KINDS = (HostCopy, FencedBuckets, FrozenRead)  # exactly these types: a subclass could read anything later


def _checked(item: Any, what: str) -> Taken:
    if type(item) not in KINDS:
        raise CheckpointError(f"{what} hands an asynchronous save's thread {type(item).__name__}, which it would "
                              "read after the call returns; allowed: " + ", ".join(k.__name__ for k in KINDS)
                              + " (checkpoint/taken.py)")
    return item


@dataclass(frozen=True)
class Capture:
    """What an asynchronous save's thread writes for this rank: each entry's take, in the entries' order."""

    taken: tuple[Taken, ...]

    def __post_init__(self):
        _tuple(self.taken, "a capture")
        for item in self.taken:
            _checked(item, "a capture")

    @classmethod
    def of(cls, entries: Iterable[Entry]) -> Capture:
        """On the caller's thread: every entry's take, now (the optimizer's holds the fence)."""
        return cls(tuple(_checked(entry.take(), f"entry {entry.what!r}") for entry in entries))

    def parts(self, after_fence: Callable[[], None] | None = None) -> Iterator[Part]:
        """On the save's thread: this rank's datasets. ``after_fence`` is called once the fenced buckets are
        written and released, before the rest: training may change anything from then on."""
        for item in self.taken:
            yield from item.parts()
            if after_fence is not None and type(item) is FencedBuckets:
                after_fence()


def check_plain(value: Any, what: str) -> None:
    """Raise CheckpointError unless ``value`` is plain data (JSON values, tuples, paths, dataclasses and
    NamedTuples of them, arrays of numpy's own memory, made read-only): no tensor, no callable."""
    if value is None or isinstance(value, (bool, int, float, str, Path)):
        return
    if isinstance(value, np.ndarray):
        _frozen_array(value, what)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{what}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_plain(k, f"{what} key")
            check_plain(v, f"{what}[{k!r}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            check_plain(getattr(value, f.name), f"{what}.{f.name}")
    else:
        raise CheckpointError(f"an asynchronous save would read {what}, a {type(value).__name__}, after the call "
                              "returns; its thread takes plain data (checkpoint/taken.py)")
