"""What one backward does (:class:`Backward`, as iteration.py's machine decides it), and what the sharded
model tells an optimizer that updates during backward (optimizer_in_backward, :class:`BackwardSteps`).

In a backward that ends an accumulation window, the sharded model announces
each unit's trainable buckets as the unit's backward begins (``coming``: time
to read their optimizer state) and hands over each bucket once its gradient is
reduced for the last time (``reduced``: update it now). Both come in the same
order on every rank, since the reductions they follow are collectives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from zerompi.shard.bucket import Bucket


class Backward(NamedTuple):
    """What one backward does, as the machine decides it when the backward begins."""

    ends_window: bool
    """It completes the accumulation window (stages 0-1 reduce gradients then)."""
    updates: bool
    """Buckets are updated during it, as their gradients become final (IN_BACKWARD, last of a window)."""
    sources: int = 0
    """micro_batches: how many ranks run a micro-batch in this round."""


class BackwardSteps(Protocol):
    def coming(self, buckets: list[Bucket]) -> None:
        """A unit's backward begins: these buckets' gradients are next."""

    def reduced(self, bucket: Bucket) -> None:
        """``bucket``'s gradient is final for this window (its shard is reduced and released)."""
