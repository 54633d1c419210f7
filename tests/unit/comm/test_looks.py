"""The rule that decides whether an overdue wait is blamed yet (comm/looks.py), clause by clause, with
explicit times: no clock, no threads. Each test names the break it guards against."""
from __future__ import annotations

from pathlib import Path

import pytest

from zerompi.comm.looks import LOOK_GAP, LOOK_SLACK, MOVING_LIMIT, Looks, Verdict, look_wait, poll_every

D = 8.0  # a deadline long enough that a quarter of it (2 s) exceeds the watchdog's 1 s poll


def test_the_first_overdue_cycle_looks():
    assert Looks().next(now=100.0, waited=D + 0.1, deadline=D) is Verdict.LOOK


def test_a_wait_that_is_not_overdue_is_left_alone():
    assert Looks().next(now=100.0, waited=None, deadline=D) is Verdict.WAIT


def test_looks_come_at_most_every_look_gap_deadlines():
    """Guards: a watchdog that looks every poll (1 s): a rank moving every 1.5 s then looks stopped."""
    looks = Looks()
    assert looks.saw(100.0, {0: 5, 1: 7}) is Verdict.WAIT
    gap = LOOK_GAP * D
    for now in (100.0, 100.0 + 1.0, 100.0 + gap - 0.01):
        assert looks.next(now, waited=D + 1, deadline=D) is Verdict.WAIT, now
    assert looks.next(100.0 + gap, waited=D + 1, deadline=D) is Verdict.LOOK
    assert looks.next(100.0 + gap + 5, waited=D + 1, deadline=D) is Verdict.LOOK


def test_the_gap_counts_from_the_last_look_not_from_zero():
    """Guards: a gap measured as now + last (never below it) or as LOOK_GAP / deadline."""
    looks = Looks()
    looks.saw(1000.0, {0: 1})
    assert looks.next(1000.0 + 0.5, waited=D + 1, deadline=D) is Verdict.WAIT
    short = Looks()
    short.saw(1000.0, {0: 1})
    assert short.next(1000.0 + 0.5, waited=0.3, deadline=0.2) is Verdict.LOOK  # gap 0.05 s


def test_two_agreeing_looks_blame_the_wait():
    looks = Looks()
    assert looks.saw(100.0, {0: 5, 1: 7}) is Verdict.WAIT
    assert looks.saw(102.0, {0: 5, 1: 7}) is Verdict.STOPPED


def test_a_look_that_differs_becomes_the_last_look():
    """Guards: a look that is not kept (only the MOVING_LIMIT fallback would then ever blame), or one kept
    against the wrong field."""
    looks = Looks()
    looks.saw(100.0, {0: 5, 1: 7})
    assert looks.saw(102.0, {0: 5, 1: 8}) is Verdict.WAIT
    assert looks.last == (102.0, {0: 5, 1: 8})
    assert looks.next(102.5, waited=D + 3, deadline=D) is Verdict.WAIT  # the gap counts from the new look
    assert looks.saw(104.0, {0: 5, 1: 8}) is Verdict.STOPPED


def test_a_rank_that_did_not_answer_either_time_agrees_with_itself():
    looks = Looks()
    looks.saw(100.0, {0: 5, 1: None})
    assert looks.saw(102.0, {0: 5, 1: None}) is Verdict.STOPPED
    looks = Looks()
    looks.saw(100.0, {0: 5, 1: None})
    assert looks.saw(102.0, {0: 5, 1: 9}) is Verdict.WAIT  # it answered: it moves


def test_a_new_wait_starts_from_a_first_look():
    """Guards: a look kept from an earlier wait; a later wait with the same counts (a rank that hangs in
    the same place again, after a slow step) would then be blamed after one look instead of two."""
    looks = Looks()
    looks.saw(100.0, {0: 5, 1: 7})
    assert looks.next(105.0, waited=None, deadline=D) is Verdict.WAIT  # the wait ended
    assert looks.last is None
    assert looks.next(120.0, waited=D + 0.1, deadline=D) is Verdict.LOOK
    assert looks.saw(120.5, {0: 5, 1: 7}) is Verdict.WAIT


@pytest.mark.parametrize("late", [0.0, 0.01, 5.0])
def test_moving_limit_deadlines_blame_whatever_the_counts(late):
    looks = Looks()
    looks.saw(100.0, {0: 5})
    assert looks.next(100.1, waited=MOVING_LIMIT * D + late, deadline=D) is Verdict.STILL_MOVING
    assert looks.next(100.1, waited=MOVING_LIMIT * D - 0.01, deadline=D) is Verdict.WAIT


@pytest.mark.parametrize("deadline, wait", [(0.2, 0.6), (2.0, 1.5), (4.0, 2.5), (60.0, 2.5)])
def test_a_look_waits_two_of_the_others_polls_and_the_slack(deadline, wait):
    """Each watchdog polls every min(1 s, deadline / 4); a look waits two of those plus LOOK_SLACK.
    Guards: a look that waits longer than that (a report later than needed) or shorter (a loaded
    rank's answer missed, so it looks stopped)."""
    assert LOOK_SLACK == 0.5 and look_wait(deadline) == pytest.approx(wait)


@pytest.mark.parametrize("deadline, every", [(0.2, 0.05), (2.0, 0.5), (4.0, 1.0), (60.0, 1.0), (None, 1.0)])
def test_a_watchdog_polls_every_quarter_deadline_at_most_a_second(deadline, every):
    """The watchdog's own period (_watch) and the looks' assumption about the others' are one function.
    Guards: a longer period (a late report, and looks that miss another rank's answer), or none without a
    deadline."""
    assert poll_every(deadline) == pytest.approx(every)


def test_the_documented_gap_and_limit_are_the_ones_used():
    """docs/fault-tolerance.md states the rule in numbers; a change of either side changes both."""
    text = " ".join((Path(__file__).parents[3] / "docs" / "fault-tolerance.md").read_text().split())
    assert LOOK_GAP == 0.25 and "twice, a quarter of the deadline apart" in text
    assert MOVING_LIMIT == 10 and f"or after {MOVING_LIMIT} deadlines" in text
