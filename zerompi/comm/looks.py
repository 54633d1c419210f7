"""Whether an overdue wait is blamed yet: the job still moves until two looks at the ranks' counts agree.

A wait past its deadline on a loaded machine (or in a slow first step) is not yet a hang: other ranks may
still be issuing collectives on their way to it. The watchdog (watchdog.py) asks every rank for its count
of collectives issued; :class:`Looks` decides, from the wait's age and the last look, whether to wait,
look (again) or blame. It holds no clock and sends nothing, so each rule is tested with explicit times.

The rule:
  - a wait that is not overdue forgets the last look (a later wait starts from a first look);
  - a wait overdue for :data:`MOVING_LIMIT` deadlines is blamed whatever the counts say, so a job that
    moves forever without this rank still ends (:attr:`Verdict.STILL_MOVING`);
  - otherwise a look comes at most every :data:`LOOK_GAP` deadlines, and two looks in a row that agree
    blame the wait (:attr:`Verdict.STOPPED`); a look that differs from the last is the new last look.
"""
from __future__ import annotations

from enum import Enum

LOOK_GAP = 0.25    # deadlines between two looks at the ranks' counts: at least 3/4 of a median step, in
#                    which a moving rank issues collectives (a step issues several)
LOOK_SLACK = 0.5   # seconds more that a look waits for answers (a loaded machine)
MOVING_LIMIT = 10  # deadlines after which a wait is blamed even if other ranks still move

Counts = dict[int, "int | None"]  # each rank's count of collectives issued (None: it did not answer)


class Verdict(Enum):
    WAIT = "wait"                  # nothing to do this cycle
    LOOK = "look"                  # ask every rank for its count, then hand the answers to Looks.saw
    STOPPED = "stopped"            # two looks agreed: nothing moves, blame the wait
    STILL_MOVING = "still moving"  # MOVING_LIMIT deadlines of waiting: blame it although ranks still move


def poll_every(deadline: float | None) -> float:
    """Seconds between a watchdog's checks: a quarter of the deadline, at most a second (a second with none)."""
    return min(1.0, (deadline or 4.0) / 4)


def look_wait(deadline: float) -> float:
    """Seconds one look waits for the answers: two of the other ranks' watchdog polls
    (:func:`poll_every`) plus :data:`LOOK_SLACK`."""
    return 2 * poll_every(deadline) + LOOK_SLACK


class Looks:
    """The last look at the ranks' counts (when, counts) during the current overdue wait."""

    def __init__(self) -> None:
        self.last: tuple[float, Counts] | None = None

    def next(self, now: float, waited: float | None, deadline: float) -> Verdict:
        """What to do at ``now`` for a wait of ``waited`` seconds (None: no overdue wait)."""
        if waited is None:
            self.last = None
            return Verdict.WAIT
        if waited >= MOVING_LIMIT * deadline:
            return Verdict.STILL_MOVING
        if self.last is not None and now - self.last[0] < LOOK_GAP * deadline:
            return Verdict.WAIT
        return Verdict.LOOK

    def saw(self, when: float, counts: Counts) -> Verdict:
        """The answers of the look that ended at ``when``: STOPPED if they agree with the last look, else
        WAIT (they become the last look)."""
        if self.last is not None and counts == self.last[1]:
            return Verdict.STOPPED
        self.last = (when, dict(counts))
        return Verdict.WAIT
