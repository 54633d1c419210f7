"""Stage 3's unit schedule: when each gather unit's buckets are gathered, prefetched and released.

Each unit's entries get forward hooks (hooks.py): before the forward the unit is gathered and the next
units are prefetched (prefetch.py); after it the unit is released and its output's backward is hooked,
which gathers it again and prefetches in backward order. A unit's frozen buckets are released when its
backward is over; trainable ones once their gradients are reduced (sharded.py). Under micro_batches the
schedule also records the gathers that a round without a micro-batch replays (rounds.py's RoundGathers).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zerompi.log import get_logger
from zerompi.shard.collectives import BucketState
from zerompi.shard.hooks import HookSet
from zerompi.shard.prefetch import Prefetcher
from zerompi.shard.rounds import RoundGathers
from zerompi.shard.units import Unit

logger = get_logger(__name__)


class UnitSchedule:
    """Gathers, prefetches and releases ``units`` around their forwards and backwards.

    Args:
        module: the model; its own forward begins a pass where no root unit does, or where a dealt
            batch counts passes (installed before its unit's hooks).
        units: stage 3's gather units (none below stage 3).
        hooks: where the forward and backward hooks go (installed here, at construction).
        prefetcher: which units to start gathering ahead.
        dealt: micro_batches deal the batch in rounds (the gathers of a round are recorded for replay).
        in_backward: whether a backward is in progress (a forward then is a recomputation under
            activation checkpointing: nothing is released or prefetched).
        coming: told, before a unit's backward, which units' gradients come next (optimizer_in_backward).
    """

    def __init__(self, module: nn.Module, units: list[Unit], hooks: HookSet, prefetcher: Prefetcher, dealt: bool,
                 in_backward: Callable[[], bool], coming: Callable[[list[Unit]], None]):
        self.hooks, self.prefetcher, self.dealt = hooks, prefetcher, dealt
        self._in_backward, self._coming = in_backward, coming
        self._replay = RoundGathers()
        for unit in units:
            for entry in unit.entries:
                hooks.around_forward(entry, lambda a, k, u=unit, m=entry: self._pre_forward(u, m, a, k),
                                     lambda out, u=unit, m=entry: self._post_forward(u, m, out))
        # stage 3 with no root unit: no unit's forward tells the prefetcher that a pass begins; the model's does
        self._rootless = bool(units) and all(u.fqn != "" for u in units)
        if dealt or self._rootless:  # the model's forward begins a pass (prepended: before its unit's)
            hooks.around_forward(module, lambda _a, _k: self._begin_pass(), lambda _out: None)

    def replay_last_round(self) -> None:
        """A round this rank runs no micro-batch in: the gathers of its own last complete round, the same
        ones in the same order as the others' (nothing is prefetched in this mode)."""
        for c in self._replay.last:
            c.unshard()
            c.wait_gathered()
            c.reshard()

    def round_done(self) -> None:
        self._replay.round_done()

    def _pre_forward(self, unit: Unit, entry: nn.Module, args: tuple, kwargs: dict):
        logger.debug("pre-forward %s", unit.fqn or "<root>")
        self._gather(unit)
        if unit.active is not None:  # an enclosing entry of the same unit gathered it
            return None
        unit.active = entry
        if self._in_backward():  # recomputation under activation checkpointing
            return None
        for u in self.prefetcher.forward(unit, root=unit.fqn == ""):
            u.prefetch()
        if torch.is_grad_enabled() and unit.has_frozen:
            # frozen buckets have no gradient to tell when their unit's backward is over: the
            # gradients of its inputs do (else they wait for the end of the backward)
            return self.hooks.after_backward_of(args, kwargs, lambda: self._post_backward(unit))
        return None

    def _begin_pass(self) -> None:
        if not self._in_backward():  # not a recomputation under activation checkpointing
            self._replay.begin_pass()
            if self._rootless:
                self.prefetcher.begin_pass()

    def _post_backward(self, unit: Unit) -> None:
        """The unit's backward has run: its frozen buckets are released (trainable ones are, once
        their gradients are reduced)."""
        logger.debug("post-backward %s", unit.fqn or "<root>")
        unit.release(frozen_only=True)

    def _gather(self, unit: Unit) -> None:
        backward = self._in_backward()
        for c in unit.members:
            if self.dealt and c.state is BucketState.SHARDED and (backward or torch.is_grad_enabled()):
                self._replay.gathered(c, backward)
            c.unshard()
            c.wait_gathered()

    def _post_forward(self, unit: Unit, entry: nn.Module, output) -> None:
        if unit.active is not entry:
            return  # a nested entry: the enclosing one releases the unit
        unit.active = None
        if self._in_backward():
            return  # recomputation under activation checkpointing: backward needs them now
        unit.release()
        if torch.is_grad_enabled():
            self.hooks.before_backward_of(output, lambda n=self._replay.passes: self._pre_backward(unit, n))

    def _pre_backward(self, unit: Unit, forward_pass: int) -> None:
        logger.debug("pre-backward %s", unit.fqn or "<root>")
        if self.dealt:  # only rounds end and forget what they reached
            self._replay.backward_reached(forward_pass)
        self._gather(unit)
        ahead = self.prefetcher.backward(unit)
        for u in ahead:
            u.prefetch()
        self._coming([unit, *ahead])
