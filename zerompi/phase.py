"""The engine's training phase: an explicit state machine with checked transitions.

::

    IDLE --backward()--> BACKWARD --(window not complete)--> ACCUMULATING --backward()--> BACKWARD
                            |  (window complete)
                            v
                          READY --step()--> STEP --> IDLE (also when the step raises)

A backward that raises goes back to where it started (its gradients are not
reduced). ``step()`` in ACCUMULATING returns without updating; anything else
not drawn above raises :class:`UsageError` naming both phases.

``optimizer_in_backward`` is a schedule of this machine (UpdateSchedule.IN_BACKWARD):
the backward that completes a window also updates each bucket as its gradient becomes
final, and STEP completes the step (the global norm, the rest). ``begin_backward`` says
which, once, for the sharded model and the optimizer to follow.
"""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from zerompi.config.choices import UpdateSchedule
from zerompi.errors import UsageError


class Phase(Enum):
    IDLE = "idle"                  # no gradient since the last step
    BACKWARD = "backward"          # inside engine.backward()
    ACCUMULATING = "accumulating"  # some micro-batches of the window are in
    READY = "ready"                # the window is complete: step() updates
    STEP = "step"                  # inside the optimizer step


_ALLOWED = {
    Phase.IDLE: {Phase.BACKWARD},
    Phase.BACKWARD: {Phase.ACCUMULATING, Phase.READY, Phase.IDLE},
    Phase.ACCUMULATING: {Phase.BACKWARD},
    Phase.READY: {Phase.STEP},
    Phase.STEP: {Phase.IDLE},
}
_HINTS = {
    (Phase.READY, Phase.BACKWARD): "call engine.step() after each window of grad_accum_steps backward calls",
    (Phase.IDLE, Phase.STEP): "there are no gradients to apply: call engine.backward() first",
    (Phase.STEP, Phase.BACKWARD): "backward() inside step()",
}


class Backward(NamedTuple):
    """What one backward does, as the machine decides it when the backward begins."""

    ends_window: bool
    """It completes the accumulation window (stages 0-1 reduce gradients then)."""
    updates: bool
    """Buckets are updated during it, as their gradients become final (IN_BACKWARD, last of a window)."""
    sources: int = 0
    """reproducible=True: how many ranks ran a micro-batch in this round (the engine fills it in)."""


class PhaseTracker:
    """The phase and the micro-batches of the current accumulation window."""

    def __init__(self, accum: int, schedule: UpdateSchedule = UpdateSchedule.AFTER_BACKWARD):
        self.accum, self.schedule = accum, schedule
        self.phase = Phase.IDLE
        self.micro = 0  # backward calls completed in this window

    def _move(self, to: Phase) -> None:
        if to not in _ALLOWED[self.phase]:
            hint = _HINTS.get((self.phase, to), "")
            raise UsageError(f"the engine cannot go from {self.phase.name} to {to.name}"
                             + (f": {hint}" if hint else ""))
        self.phase = to

    @property
    def rounds_done(self) -> int:
        """Backward calls completed in this window (a backward in progress is round ``rounds_done``)."""
        return self.micro

    def begin_backward(self) -> Backward:
        """Enter BACKWARD; what this backward does (whether it completes the window and updates)."""
        if self.phase is Phase.READY:
            raise UsageError(f"backward() called {self.micro + 1} times without step() "
                             f"(grad_accum_steps={self.accum}); call engine.step() after each backward")
        self._move(Phase.BACKWARD)
        ends = self.micro + 1 == self.accum
        return Backward(ends, ends and self.schedule is UpdateSchedule.IN_BACKWARD)

    def end_backward(self, ok: bool) -> None:
        """Leave BACKWARD: counted when it succeeded, else back to where it started."""
        if ok:
            self.micro += 1
        if self.micro == 0:
            self._move(Phase.IDLE)
        else:
            self._move(Phase.READY if self.micro == self.accum else Phase.ACCUMULATING)

    def begin_step(self) -> bool:
        """Enter STEP when the window is complete (True); in ACCUMULATING there is nothing to do."""
        if self.phase is Phase.IDLE:
            raise UsageError("step() called before backward(): there are no gradients to apply")
        if self.phase is Phase.ACCUMULATING:
            return False
        self._move(Phase.STEP)
        return True

    def end_step(self) -> None:
        """Leave STEP: a new window begins, also after a step that raised (its gradients are gone)."""
        self.micro = 0
        self._move(Phase.IDLE)

    def reset(self) -> None:
        """A loaded checkpoint starts a new window."""
        if self.phase in (Phase.BACKWARD, Phase.STEP):
            raise UsageError(f"cannot load a checkpoint in phase {self.phase.name}")
        self.phase, self.micro = Phase.IDLE, 0

    @property
    def idle(self) -> bool:
        return self.phase is Phase.IDLE
