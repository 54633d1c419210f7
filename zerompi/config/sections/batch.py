"""The batch section: gradient accumulation, the global batch of micro-batches and the reproducible mode.

``cfg.batch`` is the policy built from these keys once: what the iteration machine, the micro-batch
plan and the gradient rounds take."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zerompi.config import checks
from zerompi.config.declare import build, key
from zerompi.config.choices import Rounds


@dataclass(frozen=True)
class BatchPolicy:
    """How many micro-batches make a step and how their gradients are summed."""

    grad_accum_steps: int
    """Micro-batches per rank per step, when micro_batches is None."""
    micro_batches: int | None
    """Micro-batches per step over all ranks, dealt round robin (None: grad_accum_steps per rank)."""
    reproducible: bool
    """The micro-batches' gradients summed in the order of their global index."""

    @property
    def rounds(self) -> Rounds:
        """How a step's gradients are gathered: from ``micro_batches`` and ``reproducible``."""
        if self.micro_batches is None:
            return Rounds.WINDOW
        return Rounds.ORDERED if self.reproducible else Rounds.SUMMED


@dataclass(frozen=True, kw_only=True)
class BatchKeys:
    """The batch section's keys (ZeroConfig's fields) and its policy."""

    grad_accum_steps: int = key(1, checks.whole(1), spelled={"DeepSpeed": "gradient_accumulation_steps"})
    """Micro-batches whose gradients are summed before each optimizer step, >= 1."""
    micro_batches: int | None = key(None, checks.maybe(checks.whole(1), "off"))
    """Micro-batches per step over all ranks (the global batch, >= the world size), dealt round robin
    (``engine.micro_batch_indices()``); the gradient is their mean. None: ``grad_accum_steps`` per rank."""
    reproducible: bool = key(False, checks.boolean)
    """Train bitwise the same model at any world size N in 1..micro_batches: the micro-batches'
    gradients are summed in the order of their global index, whatever rank ran them, and every
    rank runs the micro-batches ``engine.micro_batch_indices()`` gives it (round robin). Stages
    0-3 (0 and 1 run stage 2's gradient path), flat groups, fp32 or bf16, explicit ``cpu_threads``;
    config/reproducible.py lists what else it needs. See docs/reproducible.md."""

    @cached_property
    def batch(self) -> BatchPolicy:
        """Accumulation, micro-batches and the order their gradients are summed in."""
        return build(BatchPolicy, self, BatchKeys)

    @property
    def rounds(self) -> Rounds:
        """How a step's gradients are gathered: from ``micro_batches`` and ``reproducible``."""
        return self.batch.rounds
