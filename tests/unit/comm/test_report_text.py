"""The hang report's text, whole (comm/diagnosis.py's format_report): what a user reads first when a job
hangs. Two reports are pinned line by line: a divergence (the culprit's whole stack, the camps, every
rank grouped by its state and innermost frames, the records' directory) and a job whose missing ranks
outnumber the detailed culprits. The smaller rules beside them: a tie that every rank shares names no
one, a rank past its previous step's end is off its pattern, the reason says when missing ranks join a
divergence, and a rank's state reads as it should with no events, a waited time and an event number.

Guards the mutants of diagnosis.py that survived the clause tests of test_hang.py
(benchmarks/results/mutation-comm-diagnosis.md)."""
from __future__ import annotations

from tests.unit.comm.test_hang import STEP, record
from zerompi.comm import diagnosis

DIVERGENCE = """\
zerompi hang report: 3 ranks, 3 answered; rank 0 waited 3.0 s
culprit: rank(s) 2 (the other 2 rank(s) agree at this event)
  rank 2: not in a collective: in user code, after event #2 (reduce_scatter of 8 B for b), step 0
    train.py:10 in f0: line y
    train.py:11 in f1: line y
    train.py:12 in f2: line y
    train.py:13 in f3: line y
    train.py:14 in f4: line y
first divergence: event #3
  rank(s) 0-1: all_reduce of 8 B for norm
  rank(s) 2: not reached (has not issued it)
every rank:
  rank(s) 0-1: waiting in all_reduce for norm [event #3]
    train.py:12 in f2: line x
    train.py:13 in f3: line x
    train.py:14 in f4: line x
  rank(s) 2 (h pid 102): not in a collective: in user code, after event #2 (reduce_scatter of 8 B for b), step 0
    train.py:12 in f2: line y
    train.py:13 in f3: line y
    train.py:14 in f4: line y
records: /d (`zerompi diagnose /d` prints this report again)
"""

MISSING = """\
zerompi hang report: 7 ranks, 2 answered
culprit: rank(s) 2-6 (every rank that answered is at the same collective; the missing ranks are not)
  rank 2: missing (no record: killed, or stuck where it cannot answer)
  rank 3: missing (no record: killed, or stuck where it cannot answer)
  rank 4: missing (no record: killed, or stuck where it cannot answer)
  rank 5: missing (no record: killed, or stuck where it cannot answer)
  ... 1 more culprit rank(s): see below
every rank:
  rank(s) 0 (h pid 100): waiting in all_reduce for norm
    train.py:0 in loop: x
  rank(s) 1 (h pid 101): waiting in all_reduce for norm
    train.py:1 in loop: x
  rank(s) 2-6: missing
"""


def test_a_divergence_report_line_by_line():
    """Ranks 0 and 1 share their state and innermost three frames (their outermost differs): one group."""
    recs = {0: record(0, 3, STEP), 1: record(1, 3, STEP), 2: record(2, 3, STEP[:3], waiting=False)}
    for r in range(3):
        recs[r]["stack"] = [f"train.py:{10 + i} in f{i}: line {'x' if r < 2 else 'y'}" for i in range(5)]
    recs[1]["stack"][0] = "train.py:10 in f0: other"
    recs[0]["waiting_event"] = recs[1]["waiting_event"] = 3
    report = diagnosis.diagnose(recs, 3, ("n1", "n1", "n2"))
    assert diagnosis.format_report(report, directory="/d", trigger="rank 0 waited 3.0 s") == DIVERGENCE


def test_missing_ranks_beyond_the_detailed_culprits_line_by_line():
    assert diagnosis.format_report(diagnosis.diagnose({r: record(r, 7, STEP) for r in (0, 1)}, 7)) == MISSING
    four = diagnosis.format_report(diagnosis.diagnose({r: record(r, 6, STEP) for r in (0, 1)}, 6))
    assert "  rank 5: missing" in four and "more culprit" not in four  # as many as are detailed: all shown


def test_a_tie_every_rank_shares_names_no_one():
    """Both ranks in user code, or both off their step pattern: neither stands out, so neither is named."""
    idle = {r: record(r, 2, STEP[:3] + [("all_gather", f"x{r}")], waiting=False) for r in range(2)}
    assert diagnosis.diagnose(idle, 2).culprits == []
    steps = {i: i // 4 for i in range(8)}
    off = {r: record(r, 2, STEP + STEP[:3] + [("all_gather", f"y{r}")], step_of=steps) for r in range(2)}
    report = diagnosis.diagnose(off, 2)
    assert report.divergence.index == 7 and report.culprits == [] and "none is named" in report.reason


def test_a_rank_past_its_previous_steps_end_is_off_its_pattern():
    steps = {i: 0 if i < 4 else 1 for i in range(9)}
    longer = record(0, 2, STEP + STEP + [("all_gather", "a")], step_of=steps)  # event 8: a fifth of step 1
    assert diagnosis._off_pattern(longer, 8) and not diagnosis._off_pattern(longer, 5)
    assert not diagnosis._off_pattern(longer, 99)  # no event there
    assert not diagnosis._off_pattern(record(0, 2, STEP), 2)  # no previous step in the ring


def test_missing_ranks_beside_a_divergence_are_said_to_be_missing():
    recs = {0: record(0, 4, STEP), 1: record(1, 4, STEP), 2: record(2, 4, STEP[:3], waiting=False)}
    report = diagnosis.diagnose(recs, 4)
    assert report.culprits == [2, 3] and report.reason.endswith("; ranks with no record are missing")


def test_a_ranks_state_with_no_event_a_waited_time_and_an_event_number():
    fresh = record(0, 2, STEP[:1], waiting=False)
    fresh["events"] = []
    assert diagnosis.where(fresh) == "not in a collective: in user code, before its first collective, step 0"
    waiting = record(1, 2, STEP)
    assert diagnosis.where(waiting) == "waiting 3.0 s in all_reduce for norm"  # timed unless asked not to be
    waiting["waiting_event"] = 3
    assert diagnosis.where(waiting, timed=False) == "waiting in all_reduce for norm [event #3]"


def test_a_record_is_written_where_asked_even_into_a_new_directory(tmp_path):
    path = diagnosis.write_record(tmp_path / "new" / "dir", record(3, 4, STEP))
    assert path == tmp_path / "new" / "dir" / "rank-00003.json" and diagnosis.load_records(path.parent)[1] == 4
