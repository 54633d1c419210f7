"""The engine's phase machine: the transitions drawn in zerompi/phase.py and nothing else."""
from __future__ import annotations

import pytest

from zerompi.errors import UsageError
from zerompi.config import UpdateSchedule
from zerompi.phase import Backward, Phase, PhaseTracker


def test_a_window_of_two_micro_batches():
    t = PhaseTracker(accum=2)
    assert t.phase is Phase.IDLE and t.idle
    assert t.begin_backward() == Backward(ends_window=False, updates=False)  # first of two
    assert t.phase is Phase.BACKWARD
    t.end_backward(ok=True)
    assert t.phase is Phase.ACCUMULATING and t.micro == 1
    assert t.begin_step() is False and t.phase is Phase.ACCUMULATING  # nothing to do yet
    assert t.begin_backward() == Backward(ends_window=True, updates=False)
    t.end_backward(ok=True)
    assert t.phase is Phase.READY
    assert t.begin_step() is True and t.phase is Phase.STEP
    t.end_step()
    assert t.phase is Phase.IDLE and t.micro == 0


def test_the_in_backward_schedule_updates_in_the_last_backward_of_a_window():
    t = PhaseTracker(accum=3, schedule=UpdateSchedule.IN_BACKWARD)
    plans = []
    for _ in range(3):
        plans.append(t.begin_backward())
        t.end_backward(ok=True)
    assert [(p.ends_window, p.updates) for p in plans] == [(False, False), (False, False), (True, True)]
    assert t.begin_step() is True  # step() completes it: the global norm, the rest
    t.end_step()
    assert t.begin_backward().updates is False  # a new window


def test_a_failed_backward_goes_back_where_it_started():
    t = PhaseTracker(accum=2)
    t.begin_backward()
    t.end_backward(ok=False)
    assert t.phase is Phase.IDLE and t.micro == 0
    t.begin_backward()
    t.end_backward(ok=True)
    t.begin_backward()
    t.end_backward(ok=False)
    assert t.phase is Phase.ACCUMULATING and t.micro == 1


def test_illegal_transitions_name_both_phases():
    t = PhaseTracker(accum=1)
    with pytest.raises(UsageError, match="step\\(\\) called before backward"):
        t.begin_step()
    t.begin_backward()
    with pytest.raises(UsageError, match="from BACKWARD to BACKWARD"):
        t.begin_backward()
    t.end_backward(ok=True)
    with pytest.raises(UsageError, match="backward\\(\\) called 2 times without step\\(\\)"):
        t.begin_backward()
    t.begin_step()
    with pytest.raises(UsageError, match="from STEP to BACKWARD: backward\\(\\) inside step"):
        t.begin_backward()
    with pytest.raises(UsageError, match="cannot load a checkpoint in phase STEP"):
        t.reset()
    t.end_step()
    t.reset()
    assert t.idle
