"""The hang recorder, the report and its divergence finding, and the watchdog's exchange, without MPI."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from zerompi.comm import diagnosis
from zerompi.comm.local import run_ranks
from zerompi.comm.recorder import RING, Recorder, user_stack
from zerompi.comm.watchdog import ABORT_CODE, FACTOR, HANG_CODE, TAG_PROGRESS, HangPolicy, Watchdog
from zerompi.tools.cli import main

# ---- the recorder -----------------------------------------------------------------------------


def test_ring_keeps_the_last_events_numbered_in_issue_order():
    rec = Recorder(size=4)
    for i in range(10):
        rec.begin("all_gather", "", f"bucket {i}", 8 * i)
    assert rec.count == 10 and [e.index for e in rec.events] == [6, 7, 8, 9]
    assert [e.what for e in rec.events] == ["bucket 6", "bucket 7", "bucket 8", "bucket 9"]
    assert Recorder().events.maxlen == RING


def test_median_step_leaves_out_the_warm_up_step():
    rec = Recorder()
    assert rec.median_step() is None
    rec._step_times.extend([10.0, 0.1])
    assert rec.median_step() == pytest.approx(5.05)  # two steps: both count
    rec._step_times.extend([0.2, 0.3])
    assert rec.median_step() == pytest.approx(0.2)   # the 10 s first step is left out


def test_deadline_is_the_timeout_else_the_floor_or_a_few_median_steps():
    assert HangPolicy(5.0, 30.0, None).deadline(100.0) == 5.0
    assert HangPolicy(None, 30.0, None).deadline(None) == 30.0
    assert HangPolicy(None, 30.0, None).deadline(1.0) == 30.0
    assert HangPolicy(None, 30.0, None).deadline(20.0) == FACTOR * 20.0
    assert HangPolicy(None, None, None).deadline(20.0) is None and not HangPolicy(None, None, None).active


def test_every_group_of_a_process_records_into_one_ring():
    def body(group):
        sub = group.split(group.rank % 2, group.rank, "intra")
        group.all_reduce(torch.ones(3))
        sub.all_gather(torch.ones(2), torch.empty(2 * sub.size), what="bucket 1")
        group.barrier()
        group.allgather_object({"x": 1})
        return group.monitor.recorder.snapshot(group.rank, group.size, None, "test")
    records = run_ranks(4, body)
    for record in records:
        kinds = [(e[1], e[2], e[3], e[4]) for e in record["events"]]
        assert kinds[-4:] == [("all_reduce", "", "", 12), ("all_gather", "intra", "bucket 1", 16),
                              ("barrier", "", "", 0), ("allgather_object", "", "metadata", 0)]
        assert all(e[6] is not None for e in record["events"])  # every one ended
        assert record["waiting"] is None and record["count"] == len(record["events"])
    assert diagnosis.find_divergence({r: rec for r, rec in enumerate(records)}) is None


def test_user_stack_keeps_the_callers_frames_and_names_the_library_frame():
    stacks = []

    def user_function():
        stacks.append(user_stack(threading.get_ident()))
    user_function()
    assert any("in user_function: stacks.append" in line for line in stacks[0])
    assert all("zerompi/comm" not in line for line in stacks[0][:-1])


# ---- the report -------------------------------------------------------------------------------

def record(rank, size, sigs, *, waiting=True, step_of=None, first=0, error=None):
    """A rank's record with events ``sigs`` (kind, what) numbered from ``first``; ``step_of[i]``
    is the step of event i (default 0)."""
    events = [[first + i, kind, "", what, 8, 1.0, None if waiting and i == len(sigs) - 1 else 0.5,
               (step_of or {}).get(first + i, 0)] for i, (kind, what) in enumerate(sigs)]
    rec = {"rank": rank, "size": size, "host": "h", "pid": 100 + rank, "steps": 0, "count": first + len(sigs),
           "events": events, "waiting": f"{sigs[-1][0]} for {sigs[-1][1]}" if waiting else None,
           "waited": 3.0 if waiting else None, "stack": [f"train.py:{rank} in loop: x"], "reason": "t"}
    if error:
        rec["error"] = error
    return rec


STEP = [("all_gather", "a"), ("all_gather", "b"), ("reduce_scatter", "b"), ("all_reduce", "norm")]


def test_a_rank_behind_in_user_code_is_named_by_the_majority():
    recs = {0: record(0, 3, STEP), 1: record(1, 3, STEP), 2: record(2, 3, STEP[:3], waiting=False)}
    report = diagnosis.diagnose(recs, 3)
    assert report.culprits == [2] and report.divergence.index == 3
    assert report.divergence.camps == {("all_reduce", "", "norm", 8): [0, 1], diagnosis.NOT_REACHED: [2]}
    text = diagnosis.format_report(report, directory="/d")
    assert "culprit: rank(s) 2" in text and "not in a collective: in user code" in text
    assert "train.py:2 in loop" in text and "zerompi diagnose /d" in text


def test_two_ranks_tie_broken_by_the_one_in_user_code():
    report = diagnosis.diagnose({0: record(0, 2, STEP), 1: record(1, 2, STEP[:3], waiting=False)}, 2)
    assert report.culprits == [1] and "not in a collective" in report.reason


def test_two_ranks_tie_broken_by_the_step_pattern():
    """Rank 1 runs one micro-batch more: where rank 0 reduces the norm, it gathers again."""
    steps = {i: i // 4 for i in range(8)}
    good = STEP + STEP
    extra = STEP + STEP[:3] + [("all_gather", "a")]
    report = diagnosis.diagnose({0: record(0, 2, good, step_of=steps), 1: record(1, 2, extra, step_of=steps)}, 2)
    assert report.divergence.index == 7 and report.culprits == [1]
    assert "previous step" in report.reason


def test_a_different_collective_on_one_rank_is_the_first_divergence():
    skipped = [STEP[0], STEP[2], STEP[3]]  # skipped module b's gather
    recs = {r: record(r, 4, STEP) for r in range(3)} | {3: record(3, 4, skipped)}
    report = diagnosis.diagnose(recs, 4)
    assert report.divergence.index == 1 and report.culprits == [3]
    assert report.divergence.camps[("reduce_scatter", "", "b", 8)] == [3]


def test_rings_that_start_at_different_events_are_compared_where_both_hold_them():
    recs = {0: record(0, 2, STEP[1:], first=1), 1: record(1, 2, STEP[2:3], first=2, waiting=False)}
    report = diagnosis.diagnose(recs, 2)
    assert report.divergence.index == 3 and report.culprits == [1]


def test_missing_ranks_are_culprits_when_the_others_agree():
    report = diagnosis.diagnose({0: record(0, 3, STEP), 1: record(1, 3, STEP)}, 3)
    assert report.missing == [2] and report.culprits == [2] and report.divergence is None
    assert "rank 2: missing" in diagnosis.format_report(report)


def test_a_rank_that_raised_is_the_culprit():
    recs = {0: record(0, 2, STEP), 1: record(1, 2, STEP[:2], waiting=False, error="RuntimeError: boom")}
    report = diagnosis.diagnose(recs, 2)
    assert report.culprits == [1] and "raised RuntimeError: boom" in diagnosis.format_report(report)


def test_no_culprit_when_every_rank_is_in_the_same_collective():
    report = diagnosis.diagnose({r: record(r, 2, STEP) for r in range(2)}, 2)
    assert report.culprits == [] and "no rank diverged" in report.reason


def test_the_report_groups_ranks_in_the_same_state():
    recs = {r: record(r, 16, STEP) for r in range(15)} | {15: record(15, 16, STEP[:3], waiting=False)}
    for r in range(15):
        recs[r]["stack"] = ["train.py:9 in loop: loss = engine(x)"]
    text = diagnosis.format_report(diagnosis.diagnose(recs, 16))
    assert "culprit: rank(s) 15 (" in text and "rank(s) 0-14: all_reduce of 8 B for norm" in text
    assert text.count("  rank(s) 0-14: waiting in all_reduce for norm") == 1, text
    assert diagnosis.rank_list([7, 0, 1, 2, 5, 9, 10]) == "0-2, 5, 7, 9-10"


def test_a_node_none_of_whose_ranks_answered_is_named_unreachable_with_its_ranks():
    """Node2 lost (or its link cut): ranks 2-3 sent no record. The report names node2 and its ranks, and
    each missing rank with its host; node1, whose ranks answered, is not unreachable. Break: drop the
    hosts from diagnose, and node2 appears nowhere."""
    hosts = ("node1", "node1", "node2", "node2")
    report = diagnosis.diagnose({r: record(r, 4, STEP) for r in range(2)}, 4, hosts)
    assert report.culprits == [2, 3] and report.unreachable() == {"node2": [2, 3]}
    text = diagnosis.format_report(report)
    assert "\nunreachable: node2 (rank(s) 2-3): none of its ranks answered" in text, text
    assert "  rank 2: missing on node2 (" in text and "  rank(s) 2-3: missing on node2\n" in text, text
    # one rank of a node lost: the node answered, so it is not unreachable; the rank still names its host
    report = diagnosis.diagnose({r: record(r, 4, STEP) for r in (0, 1, 2)}, 4, hosts)
    assert report.unreachable() == {} and "unreachable" not in diagnosis.format_report(report)
    assert "  rank 3: missing on node2 (" in diagnosis.format_report(report)
    # without the hosts (an in-process group, old records), the report is as before
    assert "node2" not in diagnosis.format_report(diagnosis.diagnose({r: record(r, 4, STEP) for r in range(2)}, 4))


def test_diagnose_command_names_the_unreachable_node_from_a_reporters_hosts(tmp_path, capsys):
    for r in range(2):
        diagnosis.write_record(tmp_path, {**record(r, 4, STEP), "hosts": ["node1", "node1", "node2", "node2"]})
    assert main(["diagnose", str(tmp_path)]) == 0
    assert "unreachable: node2 (rank(s) 2-3)" in capsys.readouterr().out


# ---- files and the command --------------------------------------------------------------------

def test_diagnose_command_prints_the_report_from_the_files(tmp_path, capsys):
    for r, rec in {0: record(0, 3, STEP), 1: record(1, 3, STEP[:3], waiting=False)}.items():
        diagnosis.write_record(tmp_path, rec)
    (tmp_path / "rank-00005.json").write_text("{not json")  # skipped
    assert main(["diagnose", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 ranks, 2 answered" in out and "rank 2: missing" in out and "culprit: rank(s) 1-2" in out


def test_diagnose_command_says_what_triggered_the_report_as_the_job_did(tmp_path, capsys):
    """The report's first line names its trigger: the lowest rank's reason that is not empty (the rank whose
    watchdog fired; the others' records carry none). Break guarded: the reason taken from a rank without one."""
    diagnosis.write_record(tmp_path, {**record(0, 2, STEP), "reason": ""})
    diagnosis.write_record(tmp_path, {**record(1, 2, STEP), "reason": "rank 1 waited 4.0 s in all_reduce for norm"})
    assert main(["diagnose", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "zerompi hang report: 2 ranks, 2 answered; rank 1 waited 4.0 s in all_reduce for norm", first


def test_diagnose_command_takes_the_size_given_where_the_highest_ranks_left_nothing(tmp_path, capsys):
    for r in range(2):
        diagnosis.write_record(tmp_path, record(r, 2, STEP))  # records that know of 2 ranks only
    assert main(["diagnose", "--size", "4", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 ranks, 2 answered" in out and "rank 3: missing" in out


def test_diagnose_command_without_records_is_a_clear_error(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "no readable rank record" in capsys.readouterr().err


# ---- the watchdog's exchange --------------------------------------------------------------------

class Hub:
    """In-process side channels between watchdogs of one test (what mpi.SideChannel does over MPI)."""

    def __init__(self):
        self.boxes: dict[tuple[int, int], list] = {}
        self.lock = threading.Lock()

    def channel(self, rank):
        hub = self

        class Channel:
            def post(self, dest, tag, obj):
                with hub.lock:
                    hub.boxes.setdefault((dest, tag), []).append((rank, json.loads(json.dumps(obj))))

            def poll(self, tag):
                with hub.lock:
                    return hub.boxes.pop((rank, tag), [])

            def flush(self):
                return True
        return Channel()


def test_an_overdue_rank_gets_a_report_naming_the_rank_in_user_code(tmp_path, capfd):
    hub, codes, done = Hub(), {}, threading.Event()
    policy = HangPolicy(None, 0.3, str(tmp_path))
    dogs = [Watchdog(), Watchdog()]

    def abort(rank):
        def f(code):
            codes[rank] = code
            done.set()
        return f
    recorders = [Recorder(), Recorder()]
    for r in range(2):
        recorders[r].begin("all_gather", "", "bucket 0", 8).end = time.monotonic()
    recorders[0].begin("all_gather", "", "bucket 1", 8)  # rank 1 never issues it
    dogs[1].start(policy, 1, 2, abort(1), recorders[1], hub.channel(1))
    with dogs[0].blocked("all_gather for bucket 1"):
        dogs[0].start(policy, 0, 2, abort(0), recorders[0], hub.channel(0))
        assert done.wait(20)
    for d in dogs:
        d.stop()
    assert codes == {0: HANG_CODE}
    err = capfd.readouterr().err
    assert "zerompi hang report: 2 ranks, 2 answered" in err and "culprit: rank(s) 1" in err, err
    assert "or 3 median steps); gathering the hang report, then aborting the job\n" in err, err  # a side channel
    # two agreeing looks blamed the wait, not the fallback after MOVING_LIMIT deadlines (guards: a look that
    # is never kept, or compared with the wrong field, so that nothing but the fallback ever blames)
    assert "still issued collectives" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["rank-00000.json", "rank-00001.json", "report.txt"]
    # the report names where it is, and report.txt holds it (guards: the directory left out, an empty file)
    assert f"records: {tmp_path} (`zerompi diagnose {tmp_path}`" in err, err
    report = (tmp_path / "report.txt").read_text()
    assert report.startswith("zerompi hang report: 2 ranks, 2 answered") and report in err, report


def test_an_unwritable_directory_degrades_to_the_per_rank_message(tmp_path, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("")
    codes, done = [], threading.Event()
    w = Watchdog()
    with w.blocked("a barrier"):
        w.start(HangPolicy(None, 0.2, str(blocker / "records")), 1, 4,
                lambda code: (codes.append(code), done.set()), Recorder())
        assert done.wait(10)
    w.stop()
    assert codes == [ABORT_CODE]
    err = capfd.readouterr().err
    # no side channel: no report to gather, and the deadline the wait overran is named (guards: the wrong
    # branch of the message, the deadline's text left out)
    assert "zerompi watchdog: rank 1 of 4 has waited" in err, err
    assert " in a barrier (deadline 0.2 s: hang_floor=0.2 s or 3 median steps); aborting the job\n" in err, err


def test_a_fixed_collective_timeout_is_named_as_the_limit(capfd):
    """Guards: collective_timeout's text replaced by the automatic deadline's, or left out."""
    codes, done = [], threading.Event()
    w = Watchdog()
    with w.blocked("a barrier"):
        w.start(HangPolicy(0.2, 60.0, None), 1, 4, lambda code: (codes.append(code), done.set()), Recorder())
        assert done.wait(10)
    w.stop()
    assert codes == [ABORT_CODE]
    assert " in a barrier (collective_timeout=0.2 s); aborting the job\n" in capfd.readouterr().err


def _deputy_alone(monkeypatch, capfd, directory: str | None) -> tuple[list[int], str]:
    """Rank 1 of 2 waits past its deadline and rank 0 never answers: the deputy's report. Its abort codes and
    stderr."""
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.2)
    monkeypatch.setattr("zerompi.comm.watchdog.DEPUTY_AFTER", 0.2)
    hub, codes, done = Hub(), [], threading.Event()
    w = Watchdog()
    with w.blocked("a barrier"):
        w.start(HangPolicy(None, 0.2, directory), 1, 2, lambda code: (codes.append(code), done.set()), Recorder(),
                hub.channel(1))
        assert done.wait(20), capfd.readouterr().err
    w.stop()
    return codes, capfd.readouterr().err


def test_the_deputy_reports_when_rank_0_does_not(tmp_path, monkeypatch, capfd):
    """Rank 0 is the rank that hangs and never answers: rank 1 reports, naming it, and ends the job."""
    codes, err = _deputy_alone(monkeypatch, capfd, str(tmp_path))
    assert codes == [HANG_CODE] and "rank 0 made no report in 0.4 s: rank 1 reports" in err, err
    assert "\nculprit: rank(s) 0 (" in err and "rank 0: missing" in err, err
    assert (tmp_path / "rank-00001.json").exists()


def test_a_rank_whose_report_never_comes_aborts_by_itself(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.2)
    monkeypatch.setattr("zerompi.comm.watchdog.ABORT_AFTER", 0.2)
    hub, codes, done = Hub(), [], threading.Event()
    w = Watchdog()
    with w.blocked("a barrier"):  # rank 2 of 3; neither rank 0 nor the deputy answers
        w.start(HangPolicy(None, 0.2, str(tmp_path)), 2, 3, lambda code: (codes.append(code), done.set()),
                Recorder(), hub.channel(2))
        assert done.wait(10)
    w.stop()
    assert codes == [ABORT_CODE] and "neither rank 0 nor rank 1 made a hang report" in capfd.readouterr().err
    assert (tmp_path / "rank-00002.json").exists()


# ---- the rule that picks the culprit, clause by clause (diagnosis.py's docstring) -------------

def test_clause_0_a_rank_that_raised_is_named_alone_even_beside_missing_ranks():
    """Guards: a report that adds missing or waiting ranks to a rank that raised (the 4-rank oom case
    once named ranks 0-1)."""
    recs = {0: record(0, 4, STEP[:2], waiting=False, error="RuntimeError: oom"),
            1: record(1, 4, STEP[:3]), 3: record(3, 4, STEP)}
    report = diagnosis.diagnose(recs, 4)
    assert report.culprits == [0] and report.reason == diagnosis.RAISED and report.missing == [2]


def test_clause_3_no_majority_names_no_rank_that_may_only_wait():
    """Two camps of two, every rank waiting, no step pattern to go by: no rank is named.
    Guards: the old fallback that named every rank (0-3) when none stood out."""
    recs = {r: record(r, 4, STEP[:3] + [("all_gather", "x" if r < 2 else "y")]) for r in range(4)}
    report = diagnosis.diagnose(recs, 4)
    assert report.culprits == [] and "none is named" in report.reason
    assert "\nculprit: none named (no majority" in "\n" + diagnosis.format_report(report)


def test_clause_4_missing_ranks_join_a_divergence():
    recs = {0: record(0, 3, STEP), 1: record(1, 3, STEP[:3], waiting=False)}
    assert diagnosis.diagnose(recs, 3).culprits == [1, 2]


# ---- looking again while the ranks move; a rank that raises after a report began ----------------

def _abort_into(codes, done, rank):
    def abort(code):
        codes[rank] = code
        done.set()
    return abort


def _moving_channel(hub: Hub, rank: int, recorder: Recorder, moving: threading.Event):
    """``rank``'s side channel, which issues one more collective on ``recorder`` before each answer to a
    look while ``moving`` is set: the rank moves between any two looks, however late its threads run."""
    inner = hub.channel(rank)

    class Channel:
        poll, flush = inner.poll, inner.flush

        def post(self, dest, tag, obj):
            if tag == TAG_PROGRESS and moving.is_set():
                recorder.begin("all_gather", "intra", "bucket 1", 8).end = time.monotonic()
                obj = (obj[0], recorder.count)
            inner.post(dest, tag, obj)
    return Channel()


def test_a_watchdog_does_not_blame_while_another_rank_still_moves(tmp_path, monkeypatch, capfd):
    """Rank 0 waits past its deadline (0.3 s) while rank 1 still issues collectives for 1.5 s (a loaded
    machine, a slow first step); the report comes only after rank 1 stops moving.
    Guards: a watchdog that blames at its deadline without looking whether the ranks still move
    (rank 3 once fired at the 2 s floor while the others were spread over events 8 to 38)."""
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.5)
    hub, codes, done, moving = Hub(), {}, threading.Event(), threading.Event()
    policy = HangPolicy(None, 0.3, str(tmp_path))
    dogs, recorders = [Watchdog(), Watchdog()], [Recorder(), Recorder()]
    recorders[0].begin("all_gather", "", "bucket 9", 8)
    moving.set()
    stopped_moving = []

    def stop_moving():
        moving.clear()
        stopped_moving.append(time.monotonic())
    stopper = threading.Timer(1.5, stop_moving)
    dogs[1].start(policy, 1, 2, _abort_into(codes, done, 1), recorders[1],
                  _moving_channel(hub, 1, recorders[1], moving))
    with dogs[0].blocked("all_gather for bucket 9"):
        dogs[0].start(policy, 0, 2, _abort_into(codes, done, 0), recorders[0], hub.channel(0))
        stopper.start()
        assert done.wait(20)
        reported = time.monotonic()
    stopper.join()
    for d in dogs:
        d.stop()
    assert codes == {0: HANG_CODE} and stopped_moving and reported > stopped_moving[0], capfd.readouterr().err


def test_a_job_that_moves_forever_without_the_waiting_rank_is_still_reported(tmp_path, monkeypatch, capfd):
    """Rank 1 keeps issuing collectives of a sub-group while rank 0 waits: after MOVING_LIMIT deadlines
    the wait is blamed anyway, so every hang ends."""
    from zerompi.comm import looks
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.3)
    hub, codes, done, moving = Hub(), {}, threading.Event(), threading.Event()
    policy = HangPolicy(None, 0.2, str(tmp_path))
    dogs, recorders = [Watchdog(), Watchdog()], [Recorder(), Recorder()]
    moving.set()
    dogs[1].start(policy, 1, 2, _abort_into(codes, done, 1), recorders[1],
                  _moving_channel(hub, 1, recorders[1], moving))
    with dogs[0].blocked("all_gather for bucket 9"):
        started = time.monotonic()
        dogs[0].start(policy, 0, 2, _abort_into(codes, done, 0), recorders[0], hub.channel(0))
        assert done.wait(30)
        took = time.monotonic() - started
    for d in dogs:
        d.stop()
    err = capfd.readouterr().err
    assert codes == {0: HANG_CODE} and took >= looks.MOVING_LIMIT * 0.2, (took, err)
    assert f"other ranks still issued collectives after {looks.MOVING_LIMIT} deadlines" in err, err


def _wait_for(path, seconds=20.0):
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, path
        time.sleep(0.01)


def test_rank_0_raising_after_it_answered_another_ranks_watchdog_is_named(tmp_path, monkeypatch, capfd):
    """Rank 1's watchdog fires first; rank 0 answers its request (and so reports), then raises: the report
    names rank 0 and its exception, not the waiting rank. Guards: the record of a rank that raised after a
    report began (the 4-rank oom case, where rank 1 fired first and ranks 0-1 were named)."""
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 1.0)
    hub, codes, done = Hub(), {}, threading.Event()
    policy = HangPolicy(None, 0.3, str(tmp_path))
    dogs, recorders = [Watchdog(), Watchdog()], [Recorder(), Recorder()]
    recorders[1].begin("all_gather", "", "bucket 1", 8)  # rank 0 has not issued it
    dogs[0].start(policy, 0, 2, _abort_into(codes, done, 0), recorders[0], hub.channel(0))
    with dogs[1].blocked("all_gather for bucket 1"):
        dogs[1].start(policy, 1, 2, _abort_into(codes, done, 1), recorders[1], hub.channel(1))
        _wait_for(tmp_path / "rank-00000.json")  # rank 0 has answered: its report is under way
        assert dogs[0].report_failure("RuntimeError: out of memory", ["train.py:3 in forward: torch.empty"])
        assert done.wait(20)
    for d in dogs:
        d.stop()
    err = capfd.readouterr().err
    assert codes[0] == HANG_CODE and "\nculprit: rank(s) 0 (raised an exception)" in err, err
    # rank 0 reported because rank 1 asked: the report says why with rank 1's words (guards: the asker's rank
    # number in place of its request)
    assert "zerompi hang report: 2 ranks, 2 answered; rank 1 waited" in err, err
    assert "raised RuntimeError: out of memory" in err and "train.py:3 in forward" in err, err


def test_another_rank_raising_after_it_sent_its_record_sends_it_again(tmp_path, monkeypatch, capfd):
    """3 ranks: rank 0 fires, rank 2 answers, then raises; rank 1 never answers. Rank 2's amended record
    replaces its first, so rank 0's report names rank 2 alone. Guards: an exception raised after a rank's
    record left (report_failure giving up when a report is under way), and report_failure returning before
    the report ended the job."""
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 1.5)
    hub, codes, done = Hub(), {}, threading.Event()
    policy = HangPolicy(None, 0.3, str(tmp_path))
    dogs, recorders = {0: Watchdog(), 2: Watchdog()}, {0: Recorder(), 2: Recorder()}
    recorders[0].begin("all_gather", "", "bucket 1", 8)
    from .test_watchdog_parts import watchdog_threads
    before = watchdog_threads()
    dogs[2].start(policy, 2, 3, _abort_into(codes, done, 2), recorders[2], hub.channel(2))
    (thread2,) = watchdog_threads() - before
    with dogs[0].blocked("all_gather for bucket 1"):
        dogs[0].start(policy, 0, 3, _abort_into(codes, done, 0), recorders[0], hub.channel(0))
        _wait_for(tmp_path / "rank-00002.json")
        assert dogs[2].report_failure("ValueError: bad batch", ["train.py:7 in step: check(x)"])
        assert not thread2.is_alive()  # it waited for its own watchdog's end (its bound covers the longest)
        # it returned only once the report had ended the job (its caller, the exception hook, aborts next:
        # had it returned at once, that abort would end the job before rank 0's report). Guards: the bounded
        # wait for this rank's watchdog removed, or skipped
        assert codes.get(0) == HANG_CODE, codes
    for d in dogs.values():
        d.stop()
    err = capfd.readouterr().err
    assert codes.get(0) == HANG_CODE and "\nculprit: rank(s) 2 (raised an exception)" in err, err
    assert json.loads((tmp_path / "rank-00002.json").read_text())["error"] == "ValueError: bad batch"


def test_the_deputy_has_every_record_at_three_ranks(tmp_path, monkeypatch, capfd):
    """Rank 0 is silent; ranks 1 and 2 wait in the collective it never issued. The deputy's report names
    rank 0 alone. Guards: records sent to rank 0 only, not to the deputy (the deputy then found rank 2
    missing and named an innocent rank: 0, 2)."""
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.3)
    monkeypatch.setattr("zerompi.comm.watchdog.DEPUTY_AFTER", 0.3)
    monkeypatch.setattr("zerompi.comm.watchdog.ABORT_AFTER", 0.5)
    hub, codes, done = Hub(), {}, threading.Event()
    policy = HangPolicy(None, 0.3, str(tmp_path))
    dogs, recorders = {1: Watchdog(), 2: Watchdog()}, {1: Recorder(), 2: Recorder()}
    for r in (1, 2):
        recorders[r].begin("all_gather", "", "bucket 1", 8)
    with dogs[1].blocked("all_gather for bucket 1"), dogs[2].blocked("all_gather for bucket 1"):
        for r in (1, 2):
            dogs[r].start(policy, r, 3, _abort_into(codes, done, r), recorders[r], hub.channel(r))
        assert done.wait(20)
        time.sleep(0.1)
    for d in dogs.values():
        d.stop()
    err = capfd.readouterr().err
    assert codes.get(1) == HANG_CODE and "3 ranks, 2 answered" in err, err
    assert "\nculprit: rank(s) 0 (" in err, err


def test_rank_0_sends_its_record_to_the_deputy(tmp_path, monkeypatch, capfd):
    """Rank 0 answers and then stops (its abort does not happen): the deputy, waiting longer because rank 0
    answered, reports with rank 0's record in hand. Guards: rank 0 keeping its record from the deputy."""
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.3)
    monkeypatch.setattr("zerompi.comm.watchdog.DEPUTY_AFTER", 0.3)
    monkeypatch.setattr("zerompi.comm.watchdog.ABORT_AFTER", 0.3)
    hub, codes = Hub(), {}
    deputy_done = threading.Event()
    policy = HangPolicy(None, 0.3, str(tmp_path))
    dogs, recorders = [Watchdog(), Watchdog()], [Recorder(), Recorder()]
    recorders[1].begin("all_gather", "", "bucket 1", 8)
    silent = hub.channel(0)

    class Rank0Stops:
        """Rank 0's channel: its record goes out, then nothing more arrives there (it is stopped)."""
        def post(self, dest, tag, obj):
            silent.post(dest, tag, obj)

        def poll(self, tag):
            return [] if tag == 2 else silent.poll(tag)

        def flush(self):
            return True
    dogs[0].start(policy, 0, 2, lambda code: codes.setdefault(0, code), recorders[0], Rank0Stops())
    with dogs[1].blocked("all_gather for bucket 1"):
        dogs[1].start(policy, 1, 2, _abort_into(codes, deputy_done, 1), recorders[1], hub.channel(1))
        assert deputy_done.wait(20)
    for d in dogs:
        d.stop()
    err = capfd.readouterr().err
    assert codes.get(1) == HANG_CODE and "rank 1 reports" in err and "2 ranks, 2 answered" in err, err


def test_a_look_counts_this_rank_and_ignores_an_answer_to_an_earlier_look():
    """A look (watchdog._Job.look, what the watchdog thread asks every rank) holds this rank's own count, and
    an answer that arrives after its look gave up (a loaded rank answering late) is not taken for the next
    look's. Guards: looks that share one serial number, which take the stale count as fresh (a rank that
    stopped then looks as if it moved, or as if it had not); this rank's own count left out."""
    from zerompi.comm.watchdog import TAG_PROBE, TAG_PROGRESS, _Job
    hub, recorder = Hub(), Recorder()
    for _ in range(3):
        recorder.begin("all_gather", "", "bucket", 8).end = time.monotonic()
    job = _Job(HangPolicy(None, 1.0, None), 0, 2, lambda code: None, recorder, hub.channel(0), threading.Event())
    late = hub.channel(1)
    assert job.look(0.05) == {0: 3, 1: None}  # rank 1 did not answer in time
    [(source, serial)] = late.poll(TAG_PROBE)
    late.post(source, TAG_PROGRESS, (serial, 7))  # ... and answers now, to the first look
    assert job.look(0.05) == {0: 3, 1: None}  # not an answer to this look
    [(source, serial)] = late.poll(TAG_PROBE)
    late.post(source, TAG_PROGRESS, (serial, 8))
    assert job.look(0.05)[1] is None  # the second look's answer came after it too
    [(_, serial)] = late.poll(TAG_PROBE)

    def answer():  # rank 1 in time for the fourth look
        while not (probes := late.poll(TAG_PROBE)):
            time.sleep(0.005)
        late.post(0, TAG_PROGRESS, (probes[0][1], 9))
    responder = threading.Thread(target=answer)
    responder.start()
    assert job.look(5.0) == {0: 3, 1: 9}
    responder.join()


def test_two_ranks_looking_at_once_answer_each_other():
    """Two overdue ranks look at the same time: each answers the other's probe while its own look waits, so
    both get every count. Guards: a look that answers no probe while it waits (each then sees the other as
    silent, and a rank that still moves could be blamed)."""
    from zerompi.comm.watchdog import _Job
    hub = Hub()
    recorders = [Recorder(), Recorder()]
    recorders[1].begin("all_gather", "", "bucket", 8).end = time.monotonic()
    jobs = [_Job(HangPolicy(None, 1.0, None), r, 2, lambda code: None, recorders[r], hub.channel(r),
                 threading.Event()) for r in range(2)]
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, jobs[r].look(10.0))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: {0: 0, 1: 1}, 1: {0: 0, 1: 1}}, got


def test_the_reporters_records_name_every_ranks_host(tmp_path, monkeypatch, capfd):
    """Rank 0 waits past its deadline at 3 ranks on hosts n1, n1, n2: the records of rank 0 and of the deputy
    (the two that may report) carry every rank's host, so that ``zerompi diagnose`` can name a node none
    of whose ranks wrote a record; rank 2's does not. Guards: the hosts left out of a reporter's record,
    or written into every rank's."""
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.5)
    hub, codes, done = Hub(), {}, threading.Event()
    policy, hosts = HangPolicy(None, 0.3, str(tmp_path)), ("n1", "n1", "n2")
    dogs, recorders = [Watchdog() for _ in range(3)], [Recorder() for _ in range(3)]
    recorders[0].begin("all_gather", "", "bucket 9", 8)
    for r in (1, 2):
        dogs[r].start(policy, r, 3, _abort_into(codes, done, r), recorders[r], hub.channel(r), hosts)
    with dogs[0].blocked("all_gather for bucket 9"):
        dogs[0].start(policy, 0, 3, _abort_into(codes, done, 0), recorders[0], hub.channel(0), hosts)
        assert done.wait(20)
    for d in dogs:
        d.stop()
    assert codes == {0: HANG_CODE}, capfd.readouterr().err
    for r in range(3):
        _wait_for(tmp_path / f"rank-{r:05d}.json")
    records = [json.loads((tmp_path / f"rank-{r:05d}.json").read_text()) for r in range(3)]
    assert [rec.get("hosts") for rec in records] == [list(hosts), list(hosts), None]


def test_a_look_ends_when_the_watchdog_stops():
    """A look waiting for a rank that does not answer ends when the watchdog is stopped (at exit, before MPI is
    finalised), not when its wait runs out. Guards: a look that never checks the stop (the exit then waits
    the look out, and the thread may still call MPI after finalisation)."""
    from zerompi.comm.watchdog import _Job
    stopped = threading.Event()
    job = _Job(HangPolicy(None, 1.0, None), 0, 2, lambda code: None, Recorder(), Hub().channel(0), stopped)
    took = []

    def look():
        start = time.monotonic()
        job.look(60.0)
        took.append(time.monotonic() - start)
    looker = threading.Thread(target=look, daemon=True)
    looker.start()
    time.sleep(0.1)
    stopped.set()
    looker.join(30)
    assert took and took[0] < 30, took  # the look's own wait is 60 s


def test_the_deputy_gives_rank_0_longer_once_rank_0_answered(tmp_path, monkeypatch, capfd):
    """Rank 0 sent its record (so it is reporting) but its abort has not come by the deputy's first wait: the
    deputy waits 2 ABORT_AFTER more instead of reporting over it. Guards: the deputy reporting as soon as
    GATHER_WAIT + DEPUTY_AFTER have passed, beside rank 0's own report (two reports, two aborts)."""
    from zerompi.comm.watchdog import TAG_RECORD
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.2)
    monkeypatch.setattr("zerompi.comm.watchdog.DEPUTY_AFTER", 0.2)
    monkeypatch.setattr("zerompi.comm.watchdog.ABORT_AFTER", 10.0)
    hub, codes, done = Hub(), {}, threading.Event()
    hub.channel(0).post(1, TAG_RECORD, Recorder().snapshot(0, 2, None, "rank 0 reports"))  # rank 0 answered
    w = Watchdog()
    with w.blocked("a barrier"):
        w.start(HangPolicy(None, 0.2, str(tmp_path)), 1, 2, _abort_into(codes, done, 1), Recorder(), hub.channel(1))
        _wait_for(tmp_path / "rank-00001.json")  # the deputy's run began
        reported = done.wait(2.5)  # past GATHER_WAIT + DEPUTY_AFTER, well inside the 20 s more
    w.stop()
    assert not reported and codes == {}, capfd.readouterr().err


def test_rank_0_waits_gather_wait_for_a_slow_ranks_record(tmp_path, monkeypatch, capfd):
    """Rank 1 (played here by hand) sends its record 1.5 s after rank 0's request: rank 0, which waits up to
    GATHER_WAIT (30 s here) for the records, reports with both as soon as the record is in. Guards: rank 0
    waiting only the deputy's short 0.2 s (a record from a loaded rank then missing, and that rank named as
    missing); rank 0 waiting out GATHER_WAIT with every record in (its gather not counting them, or not
    receiving while it waits)."""
    from zerompi.comm.watchdog import TAG_PROBE, TAG_PROGRESS, TAG_RECORD, TAG_REQUEST
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 30.0)
    hub, codes, done, halt = Hub(), {}, threading.Event(), threading.Event()
    recorders = [Recorder(), Recorder()]
    recorders[0].begin("all_gather", "", "bucket 1", 8)
    slow = hub.channel(1)

    def rank1():
        while not halt.is_set():
            for source, serial in slow.poll(TAG_PROBE):
                slow.post(source, TAG_PROGRESS, (serial, recorders[1].count))
            if slow.poll(TAG_REQUEST):
                time.sleep(1.5)
                slow.post(0, TAG_RECORD, recorders[1].snapshot(1, 2, None, "asked by rank 0"))
                return
            time.sleep(0.01)
    player = threading.Thread(target=rank1, daemon=True)
    player.start()
    w = Watchdog()
    with w.blocked("all_gather for bucket 1"):
        w.start(HangPolicy(None, 0.3, str(tmp_path)), 0, 2, _abort_into(codes, done, 0), recorders[0], hub.channel(0))
        assert done.wait(20)  # the report comes about 3 s in; 30 s when rank 0 waits out GATHER_WAIT
    halt.set()
    w.stop()
    err = capfd.readouterr().err
    assert codes == {0: HANG_CODE} and "zerompi hang report: 2 ranks, 2 answered" in err, err


def test_without_a_hang_dir_the_report_says_the_records_were_not_written(monkeypatch, capfd):
    """HangPolicy(directory=None): the deputy reports on stderr alone and says where the records are not.
    Guards: a record written to a directory of None (the watchdog thread then dies and the job hangs)."""
    codes, err = _deputy_alone(monkeypatch, capfd, None)
    assert codes == [HANG_CODE] and "records: not written (no hang_dir)" in err, err


def test_the_report_names_a_hang_dir_it_could_not_write(tmp_path, monkeypatch, capfd):
    """hang_dir under a file: the deputy's report says the records were not written, naming the directory and
    why. Guards: _write's reason lost (the report then says nothing of where the records went)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    codes, err = _deputy_alone(monkeypatch, capfd, str(blocker / "records"))
    assert codes == [HANG_CODE] and f"records: not written ({blocker / 'records'}: Not a directory)" in err, err


def test_a_deputy_stopped_while_it_waits_for_rank_0_reports_nothing(tmp_path, monkeypatch, capfd):
    """The job ends (the watchdog is stopped, as at exit) while the deputy waits for rank 0's report: the
    deputy neither reports nor aborts. Guards: a wait that does not end at the stop (the deputy then reports
    over a job that has ended)."""
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 1.0)
    monkeypatch.setattr("zerompi.comm.watchdog.DEPUTY_AFTER", 1.0)
    hub, codes = Hub(), []
    w = Watchdog()
    with w.blocked("a barrier"):
        w.start(HangPolicy(None, 0.2, str(tmp_path)), 1, 2, codes.append, Recorder(), hub.channel(1))
        _wait_for(tmp_path / "rank-00001.json")  # its run began: it waits 2 s for rank 0
        w.stop()
    time.sleep(3.0)
    assert codes == [] and "rank 1 reports" not in capfd.readouterr().err


def test_rank_0_takes_the_records_already_in_when_its_gather_has_no_time_left(tmp_path, monkeypatch, capfd):
    """GATHER_WAIT 0: rank 0's gathering loop does not run, and a record that came before (rank 1's, sent when
    its own watchdog fired) is still in the report. Guards: no receive after the loop (a record landing in the
    loop's last poll lost, and its rank named missing)."""
    from zerompi.comm.watchdog import TAG_RECORD
    monkeypatch.setattr("zerompi.comm.watchdog.GATHER_WAIT", 0.0)
    hub, codes, done = Hub(), {}, threading.Event()
    recorder = Recorder()
    recorder.begin("all_gather", "", "bucket 1", 8)
    hub.channel(1).post(0, TAG_RECORD, Recorder().snapshot(1, 2, None, "rank 1 sent its record"))
    w = Watchdog()
    with w.blocked("all_gather for bucket 1"):
        w.start(HangPolicy(None, 0.2, str(tmp_path)), 0, 2, _abort_into(codes, done, 0), recorder, hub.channel(0))
        assert done.wait(20)
    w.stop()
    err = capfd.readouterr().err
    assert codes == {0: HANG_CODE} and "zerompi hang report: 2 ranks, 2 answered" in err, err
