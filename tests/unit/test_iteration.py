"""The engine's iteration machine: the transitions drawn in zerompi/iteration.py and nothing else."""
from __future__ import annotations

import pytest

from zerompi.errors import UsageError
from zerompi.config import UpdateSchedule
from zerompi.iteration import Backward, Iteration, Phase
from zerompi.shard.rounds import MicroBatchPlan


def test_a_window_of_two_micro_batches():
    t = Iteration(accum=2)
    assert t.phase is Phase.IDLE and t.idle
    assert t.begin_backward()[0] == Backward(ends_window=False, updates=False)  # first of two
    assert t.phase is Phase.BACKWARD
    t.end_backward(ok=True)
    assert t.phase is Phase.ACCUMULATING and t.done == 1
    assert t.begin_step() is False and t.phase is Phase.ACCUMULATING  # nothing to do yet
    assert t.begin_backward()[0] == Backward(ends_window=True, updates=False)
    t.end_backward(ok=True)
    assert t.phase is Phase.READY
    assert t.begin_step() is True and t.phase is Phase.STEP
    t.end_step()
    assert t.phase is Phase.IDLE and t.done == 0


def test_the_in_backward_schedule_updates_in_the_last_backward_of_a_window():
    t = Iteration(accum=3, schedule=UpdateSchedule.IN_BACKWARD)
    plans = []
    for _ in range(3):
        plans.append(t.begin_backward()[0])
        t.end_backward(ok=True)
    assert [(p.ends_window, p.updates) for p in plans] == [(False, False), (False, False), (True, True)]
    assert t.begin_step() is True  # step() completes it: the global norm, the rest
    t.end_step()
    assert t.begin_backward()[0].updates is False  # a new window


def test_a_failed_backward_goes_back_where_it_started():
    t = Iteration(accum=2)
    t.begin_backward()
    t.end_backward(ok=False)
    assert t.phase is Phase.IDLE and t.done == 0
    t.begin_backward()
    t.end_backward(ok=True)
    t.begin_backward()
    t.end_backward(ok=False)
    assert t.phase is Phase.ACCUMULATING and t.done == 1


def test_illegal_transitions_name_both_phases():
    t = Iteration(accum=1)
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


def test_the_loss_factor_is_the_windows_share_times_the_loss_scale():
    t = Iteration(accum=4)
    assert t.begin_backward(loss_scale=8.0) == (Backward(ends_window=False, updates=False), 2.0)
    t.end_backward(ok=True)
    # a loss that already is its share (the frameworks' wrappers divide it): the loss scale alone
    assert t.begin_backward(loss_scale=8.0, share=False) == (Backward(ends_window=False, updates=False), 8.0)
    t.end_backward(ok=True)
    micro = Iteration(accum=1, micro=MicroBatchPlan(5, 2, 0))
    with pytest.raises(UsageError, match="already is its share of the window with micro_batches"):
        micro.begin_backward(share=False)
    assert micro.idle  # refused before entering BACKWARD


def test_micro_batches_make_the_window_this_ranks_share():
    """G=5 over N=2: rank 0 runs 0, 2, 4 (three rounds), rank 1 runs 1, 3 and an empty third round."""
    r0, r1 = (Iteration(accum=1, micro=MicroBatchPlan(5, 2, r)) for r in (0, 1))
    assert (r0.window, r1.window) == (3, 2)
    for k, want in enumerate((0, 2, 4)):
        assert r0.forward_index(training=True) == want
        backward, factor = r0.begin_backward(loss_scale=8.0)  # the loss scale is not used: 1/G
        assert backward == Backward(ends_window=k == 2, updates=False, sources=2 if k < 2 else 1) and factor == 0.2
        r0.end_backward(ok=True)
    with pytest.raises(UsageError, match="forward of a micro-batch beyond this rank's 3"):
        r0.forward_index(training=True)
    assert r0.forward_index(training=False) == 4  # evaluation reuses the last seed
    assert r0.empty_rounds() == [] and r1.empty_rounds() == [1]
    r1.begin_backward()
    r1.end_backward(ok=True)
    with pytest.raises(UsageError, match="step\\(\\) after 1 of this rank's 2 micro-batches \\[1, 3\\]"):
        r1.begin_step()


def test_step_calls_count_every_step_until_a_load():
    t = Iteration(accum=2)
    for _ in range(2):
        t.begin_backward()
        t.end_backward(ok=True)
        if t.begin_step():
            t.end_step()
    assert t.step_calls == 2 and t.idle
    t.reset()
    assert t.step_calls == 0


def test_the_boundary_is_where_step_updates_in_either_loop():
    """DeepSpeed's accumulation boundary, answered by the machine: True for the micro-batch whose step()
    updates, whether step() follows every backward (DeepSpeed's loop), comes once per window (accelerate's)
    or once after a micro_batches share."""
    def run(t: Iteration, step_each: bool, windows: int = 2) -> list[tuple[bool, bool]]:
        seen = []  # (before the backward, after it) for each backward
        for _ in range(windows):
            for k in range(t.window):
                before = t.boundary
                t.begin_backward()
                t.end_backward(ok=True)
                seen.append((before, t.boundary))
                if step_each or k == t.window - 1:
                    t.begin_step() and t.end_step()
        return seen
    each = run(Iteration(accum=3), step_each=True)
    assert each == [(False, False), (False, False), (True, True)] * 2
    once = run(Iteration(accum=3), step_each=False)
    assert once == [(False, False), (False, False), (False, True)] * 2
    micro = run(Iteration(accum=1, micro=MicroBatchPlan(5, 2, 1)), step_each=False)  # a share of 2
    assert micro == [(False, False), (False, True)] * 2
    t = Iteration(accum=2)
    t.begin_backward()
    t.end_backward(ok=True)
    t.begin_step()
    t.reset()  # a load starts a new window
    assert not t.boundary and t.window_steps == 0 and t.done == 0 and t.idle


def test_without_micro_batches_and_beyond_a_share():
    """No micro_batches: no micro-batch index, no empty round, and a loss factor of 1/accum by default; with
    them, a backward beyond the rank's share is named as that (not as a missing step())."""
    t = Iteration(accum=4)
    assert t.forward_index(training=True) is None and t.empty_rounds() == []
    assert t.begin_backward()[1] == 0.25
    r1 = Iteration(accum=1, micro=MicroBatchPlan(5, 2, 1))  # a share of 2
    for _ in range(2):
        r1.begin_backward()
        r1.end_backward(ok=True)
    with pytest.raises(UsageError, match="backward\\(\\) of a micro-batch beyond this rank's 2 micro-batches"):
        r1.begin_backward()
