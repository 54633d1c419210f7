"""Stage-3 prefetch: gather the next units' parameters while the current unit computes.

The order in which gather units run forward is recorded during the first
forward; from then on, the forward of unit k starts non-blocking all-gathers
for the units that follow it, and the backward of unit k for the units that
precede it. A forward whose order differs from the recording (data-dependent
control flow) turns prefetching off for good and says so once: prefetching
only ever moves a gather earlier, so a wrong guess costs memory, never
correctness, but a model whose order keeps changing gains nothing from it.
"""
from __future__ import annotations

import logging

from zerompi.log import get_logger

logger = get_logger(__name__)


class Prefetcher:
    """Decides which units to gather ahead; the sharded model issues and waits on the gathers."""

    def __init__(self, depth: int, budget: int | None = None, size=lambda unit: 0):
        self.depth = depth
        self.budget = budget  # max_live_params: elements gathered at once, the unit computing included
        self.size = size      # a unit's gathered elements
        self.enabled = depth > 0
        self.recording = True
        self.order: list = []          # units in forward order, as recorded on the first forward
        self._last: dict[int, int] = {}  # id(unit) -> its last position in ``order``
        self._pos = 0
        self._backward: set[int] = set()  # id() of the units whose backward began since the last forward

    def forward(self, unit, root: bool) -> list:
        """``unit`` starts its forward (``root``: a new forward pass begins); units to gather ahead."""
        if not self.enabled:
            return []
        if root:
            self.begin_pass()
        if self.recording:
            self.order.append(unit)
            return []
        if self._pos >= len(self.order) or self.order[self._pos] is not unit:
            expected = self.order[self._pos].fqn if self._pos < len(self.order) else "the end of forward"
            self._disable(f"unit '{unit.fqn or '<root>'}' ran where '{expected or '<root>'}' ran "
                          "on the first step")
            return []
        self._pos += 1
        return self._within(unit, self.order[self._pos:self._pos + self.depth])

    def begin_pass(self) -> None:
        """A forward pass begins: the root unit's forward, or the model's own where its root holds no
        parameter of its own (every one in a smaller unit), so that no unit is the root."""
        if self.recording and self.order:
            self.recording = False
            self._last = {id(u): i for i, u in enumerate(self.order)}
        self._pos, self._backward = 0, set()

    def backward(self, unit) -> list:
        """``unit`` starts its backward; the units before it in forward order come next, except those
        whose backward already began (a unit enclosing others, the root first of all, starts its
        backward before theirs: gathering it again would read or send it for nothing)."""
        self._backward.add(id(unit))
        if not self.enabled or self.recording or id(unit) not in self._last:
            return []
        i = self._last[id(unit)]
        ahead = [u for u in self.order[:i][::-1] if id(u) not in self._backward][:self.depth]
        return self._within(unit, ahead)

    def _within(self, unit, ahead: list) -> list:
        """The first of ``ahead`` that fit in the budget beside ``unit``."""
        if self.budget is None:
            return ahead
        live, out = self.size(unit), []
        for u in ahead:
            live += self.size(u)
            if live > self.budget:
                break
            out.append(u)
        return out

    def _disable(self, why: str) -> None:
        self.enabled = False
        logger.log(logging.WARNING, "stage-3 prefetch turned off: the forward order changed (%s)", why)
