"""Initial values that differ between ranks: every rank starts from rank 0's, as DDP does, and is told.

A model built without the same seed on every rank (``torch.manual_seed`` after a rank-dependent call,
or none at all) is not an error: rank 0's values are broadcast and training is correct. But the user
meant something, so the ranks whose values were replaced are named once, at ``initialize``, with the
first tensor that differed. The check costs one integer sum per broadcast tensor (its bit pattern: a
cheap digest, on the tensor's device) and one gather of a short list at the end.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from zerompi.comm.group import ProcessGroup

logger = logging.getLogger("zerompi")

SHOWN = 3  # tensors named in the warning
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat.view(_INT_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64)


def digest(t: torch.Tensor) -> int:
    """The sum of ``t``'s bit patterns as integers: equal for equal tensors, different for almost any two
    independently initialised ones (wrapping in int64 is fine for a digest)."""
    return int(_sum(t).item())


def _digests(t: torch.Tensor, parts: list[tuple[str, slice]]) -> list[int]:
    """Each part's digest, read back in one transfer (not one device sync per parameter)."""
    return torch.stack([_sum(t[part]) for _, part in parts]).tolist()


class InitialValues:
    """Collects what this rank held before each broadcast of initial values, and names the ranks that
    held something else (:meth:`report`, collective)."""

    def __init__(self) -> None:
        self.replaced: list[str] = []  # what this rank held differently from rank 0, in broadcast order

    def broadcast(self, t: torch.Tensor, parts: list[tuple[str, slice]], send: Callable[[torch.Tensor], None]) -> None:
        """``send(t)`` (rank 0's values into ``t``), noting each named part of ``t`` whose values were others."""
        if not (t.is_floating_point() or t.is_complex()):
            send(t)  # integer buffers (counters, indices): nothing a seed decides
            return
        before = _digests(t, parts)
        send(t)
        self.replaced += [name for (name, _), held, now in zip(parts, before, _digests(t, parts)) if now != held]

    def report(self, group: ProcessGroup) -> list[int]:
        """Collective: the ranks whose initial values were replaced by rank 0's (rank 0 logs a warning
        naming them, and the first few tensors of the lowest)."""
        held = group.allgather_object((self.replaced[:SHOWN], len(self.replaced)) if self.replaced else None)
        ranks = [r for r, h in enumerate(held) if h is not None]
        if ranks and group.rank == 0:
            names, count = held[ranks[0]]
            logger.warning("rank(s) %s built initial values that differ from rank 0's (on rank %d, %d tensor(s): "
                           "%s%s); every rank starts from rank 0's, as DDP does. Seed the model the same on every rank "
                           "(torch.manual_seed before building it) if this is not what was meant.",
                           ", ".join(map(str, ranks)), ranks[0], count, ", ".join(names),
                           ", ..." if count > len(names) else "")
        return ranks
