"""The iteration machine: one accumulation window, its rounds and its micro-batches, with checked phases.

::

    IDLE --backward()--> BACKWARD --(window not complete)--> ACCUMULATING --backward()--> BACKWARD
                            |  (window complete)
                            v
                          READY --step()--> STEP --> IDLE (also when the step raises)

A backward that raises goes back to where it started (its gradients are not
reduced). ``step()`` in ACCUMULATING returns without updating; anything else
not drawn above raises :class:`UsageError` naming both phases.

The window is ``grad_accum_steps`` backward calls, or, with ``micro_batches`` (shard/rounds.py),
this rank's share of the global batch: backward ``k`` is round ``k``, and the rounds this rank
has no micro-batch in are run by ``step()`` (``empty_rounds``).

``optimizer_in_backward`` is a schedule of this machine (UpdateSchedule.IN_BACKWARD):
the backward that completes a window also updates each bucket as its gradient becomes
final, and STEP completes the step (the global norm, the rest). ``begin_backward`` says
which, once, for the sharded model and the optimizer to follow.

Every engine verb asks this machine; the DeepSpeed wrapper reads its counts (``step_calls``)
instead of keeping its own, and the frameworks' wrappers run their backward through the engine's,
saying whether their loss already is its share of the window (``share``).
"""
from __future__ import annotations

from enum import Enum

from zerompi.config.choices import UpdateSchedule
from zerompi.errors import UsageError
from zerompi.shard.rounds import MicroBatchPlan
from zerompi.shard.steps import Backward


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


class Iteration:
    """The phase, the window's backward calls and the micro-batches they run.

    Args:
        accum: ``grad_accum_steps``: backward calls per window (without ``micro``).
        schedule: when buckets update (after step(), or in the window's last backward).
        micro: ``micro_batches``' plan for this rank; its share is then the window.
    """

    def __init__(self, accum: int, schedule: UpdateSchedule = UpdateSchedule.AFTER_BACKWARD,
                 micro: MicroBatchPlan | None = None):
        self.accum, self.schedule, self.micro = accum, schedule, micro
        self.window = len(micro.indices) if micro is not None else accum
        """Backward calls that complete a window on this rank."""
        self.phase = Phase.IDLE
        self.done = 0
        """Backward calls completed in this window (a backward in progress is round ``done``)."""
        self.step_calls = 0
        """step() calls since the engine was built or loaded, updating or not (DeepSpeed's micro_steps)."""
        self.window_steps = 0
        """step() calls in this window so far (each one that does not update)."""

    def _move(self, to: Phase) -> None:
        if to not in _ALLOWED[self.phase]:
            hint = _HINTS.get((self.phase, to), "")
            raise UsageError(f"the engine cannot go from {self.phase.name} to {to.name}"
                             + (f": {hint}" if hint else ""))
        self.phase = to

    @property
    def complete(self) -> bool:
        """The window's backward calls are all in (step() then updates)."""
        return self.done == self.window

    @property
    def idle(self) -> bool:
        return self.phase is Phase.IDLE

    @property
    def boundary(self) -> bool:
        """Whether the current micro-batch ends the window (DeepSpeed's accumulation boundary): the one
        whose backward ran if step() has not been called since, else the one whose backward comes next.
        A loop that calls step() after every backward and one that calls it once per window (accelerate's,
        micro_batches) both get True exactly where their step() updates."""
        if self.window_steps < self.done:
            return self.done == self.window
        return self.done + 1 == self.window

    # ---- forward ------------------------------------------------------------
    def forward_index(self, training: bool) -> int | None:
        """micro_batches: the global index of the micro-batch a forward runs (None without them);
        a training forward beyond this rank's share is refused before stage 3 gathers anything."""
        if self.micro is None:
            return None
        if training:
            self.micro.check_room(self.done, "forward")
        return self.micro.indices[min(self.done, self.window - 1)]

    # ---- backward -----------------------------------------------------------
    def begin_backward(self, loss_scale: float = 1.0, share: bool = True) -> tuple[Backward, float]:
        """Enter BACKWARD; what this backward does, and the factor its loss's gradient is scaled by
        (the fp16 loss scale and the window's share, or 1/G of a dealt micro-batch). ``share=False``:
        the caller's loss already is its share of the window, so the factor is the loss scale alone."""
        if self.micro is not None:
            if not share:
                raise UsageError("a loss that already is its share of the window with micro_batches: "
                                 "each micro-batch's share is 1/G, which the engine applies")
            self.micro.check_room(self.done, "backward()")
        if self.phase is Phase.READY:
            raise UsageError(f"backward() called {self.done + 1} times without step() "
                             f"(grad_accum_steps={self.accum}); call engine.step() after each backward")
        self._move(Phase.BACKWARD)
        ends = self.done + 1 == self.window
        backward = Backward(ends, ends and self.schedule is UpdateSchedule.IN_BACKWARD)
        if self.micro is not None:
            return backward._replace(sources=self.micro.sources(self.done)), self.micro.loss_factor
        return backward, loss_scale / self.accum if share else loss_scale

    def end_backward(self, ok: bool) -> None:
        """Leave BACKWARD: counted when it succeeded, else back to where it started."""
        if ok:
            self.done += 1
        if self.done == 0:
            self._move(Phase.IDLE)
        else:
            self._move(Phase.READY if self.complete else Phase.ACCUMULATING)

    # ---- step ---------------------------------------------------------------
    def begin_step(self) -> bool:
        """Enter STEP when the window is complete (True); in ACCUMULATING there is nothing to do."""
        if self.micro is not None and self.done not in (0, self.window):
            raise UsageError(f"step() after {self.done} of this rank's {self.window} micro-batches "
                             f"{self.micro.indices} (micro_batches={self.micro.micro_batches}): run forward and "
                             "backward once for each of engine.micro_batch_indices() before step()")
        if self.phase is Phase.IDLE:
            raise UsageError("step() called before backward(): there are no gradients to apply")
        self.step_calls += 1
        if self.phase is Phase.ACCUMULATING:
            self.window_steps += 1
            return False
        self._move(Phase.STEP)
        return True

    def empty_rounds(self) -> list[int]:
        """micro_batches: the rounds this rank ran no micro-batch in (one at most), as the number of
        ranks that did; step() runs them before updating."""
        if self.micro is None:
            return []
        return [self.micro.sources(k) for k in range(self.window, self.micro.rounds)]

    def end_step(self) -> None:
        """Leave STEP: a new window begins, also after a step that raised (its gradients are gone)."""
        self.done = self.window_steps = 0
        self._move(Phase.IDLE)

    def reset(self) -> None:
        """A loaded checkpoint starts a new window."""
        if self.phase in (Phase.BACKWARD, Phase.STEP):
            raise UsageError(f"cannot load a checkpoint in phase {self.phase.name}")
        self.phase, self.done, self.step_calls, self.window_steps = Phase.IDLE, 0, 0, 0
