"""A global batch dealt in ``micro_batches``: which micro-batches each rank runs, and the rounds they make.

``micro_batches`` (G) micro-batches per optimizer step are dealt round robin over the N ranks:
rank r runs the global indices r, r+N, r+2N, ... (N need not divide G: the first G mod N ranks
run one more). Round k is the k-th backward on every rank, so it holds the indices kN..kN+N-1
in rank order, which is what lets each shard owner add the gradients in global index order
(sync.py's OrderedRounds, reproducible=True) or sum each round as it comes (SummedRounds). A rank
with one micro-batch fewer joins the last round with nothing.

Each micro-batch also draws the same random numbers at any N: the generator is seeded from
(seed, step, global index) before its forward.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from zerompi.errors import ConfigError, UsageError


@dataclass(frozen=True)
class MicroBatchPlan:
    micro_batches: int  # G
    world_size: int     # N
    rank: int

    def __post_init__(self) -> None:
        if self.micro_batches < self.world_size:
            raise ConfigError(f"micro_batches={self.micro_batches} is smaller than the world size {self.world_size}: "
                              "every rank needs a micro-batch; allowed: micro_batches >= the number of ranks")

    @property
    def indices(self) -> list[int]:
        """The global micro-batch indices this rank runs each step, in order."""
        return list(range(self.rank, self.micro_batches, self.world_size))

    def check_room(self, done: int, what: str) -> None:
        """Raise before ``what`` starts a micro-batch beyond this rank's share (``done`` ran already):
        the other ranks would wait for it in a collective."""
        if done >= len(self.indices):
            raise UsageError(f"{what} of a micro-batch beyond this rank's {len(self.indices)} micro-batches "
                             f"{self.indices} (micro_batches={self.micro_batches}): the other ranks would wait for it in a "
                             "collective; run one forward and backward for each of engine.micro_batch_indices(), "
                             "then step()")

    @property
    def rounds(self) -> int:
        return math.ceil(self.micro_batches / self.world_size)

    def sources(self, round_: int) -> int:
        """How many ranks run a micro-batch in round ``round_`` (the first ones, in rank order)."""
        return min(self.world_size, self.micro_batches - round_ * self.world_size)

    @property
    def loss_factor(self) -> float:
        """Each micro-batch's loss is scaled by 1/G before backward: the sum is the mean gradient."""
        return 1.0 / self.micro_batches

    @staticmethod
    def seed(seed: int, step: int, index: int) -> int:
        """The generator seed of global micro-batch ``index`` at optimizer step ``step``."""
        digest = hashlib.sha256(f"zerompi/{seed}/{step}/{index}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1


class RoundGathers:
    """Stage 3 under micro_batches: the gathers a rank with no micro-batch in a round replays, so that it
    takes its part in the others' forward and backward collectives: those of its own last complete round.

    A round's gathers are those of the forward passes its backward ran through, and of the backward; a
    forward between steps whose output no backward reaches (an evaluation, with grad or under no_grad)
    is left out, since a rank replaying it would meet collectives the others do not issue."""

    def __init__(self) -> None:
        self.passes = 0                              # forward passes begun (the current one's number)
        self._gathers: list[tuple[int | None, object]] = []  # (pass, or None in backward; bucket)
        self._backed: set[int] = set()               # passes whose output a backward reached
        self.last: list = []                         # the buckets of the last complete round, in order

    def begin_pass(self) -> None:
        self.passes += 1

    def gathered(self, bucket, in_backward: bool) -> None:
        self._gathers.append((None if in_backward else self.passes, bucket))

    def backward_reached(self, forward_pass: int) -> None:
        self._backed.add(forward_pass)

    def round_done(self) -> None:
        self.last = [b for n, b in self._gathers if n is None or n in self._backed]
        self._gathers, self._backed = [], set()
