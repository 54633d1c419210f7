"""The end report: what the ranks' watchers leave when a job ends before any rank could report (sentinel.py's
end records, diagnosis.py's ``read_ends``/``format_ends``, ``zerompi diagnose``). The records are written by
real watchers of stand-in ranks in fresh processes; the job-level check (node2 of the 2-node box lost,
named by the end report in the job's log): tests/mpi/test_cluster.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from zerompi.comm import diagnosis, sentinel
from zerompi.tools.cli import main

ROOT = Path(__file__).resolve().parents[3]
HOSTS = ["node1", "node1", "node7", "node7", "node9"]

# A stand-in rank of a 5-rank job on HOSTS: it starts its watcher with a directory, then ENDING runs.
RANK = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from zerompi.comm import sentinel
sentinel.start({rank}, 5, {host!r}, {directory!r}, {hosts!r})
print(os.getpid(), sentinel._watcher.pid, flush=True)
{ending}
"""


def _rank(directory: Path, ending: str, rank: int = 2, group_kill: bool = False) -> int:
    """Run a stand-in rank that ends with ``ending`` (or, with ``group_kill``, is torn down with its process group
    as MPICH's hydra does); its pid, once its watcher has ended (so its record, if any, is written)."""
    code = RANK.format(root=str(ROOT), rank=rank, host=HOSTS[rank], directory=str(directory), hosts=tuple(HOSTS),
                       ending="time.sleep(600)" if group_kill else ending)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pid, watcher = (int(w) for w in proc.stdout.readline().split())
        if group_kill:
            os.killpg(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stderr.read()  # the watcher holds the rank's stderr until it exits
        _gone(watcher)
        return pid
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def _gone(pid: int, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z":
            return  # ended, not yet reaped by init
        time.sleep(0.02)
    raise AssertionError(f"watcher {pid} still running after {limit} s")


def _ends(directory: Path) -> dict[int, dict]:
    return diagnosis.load_ends(directory)


def test_a_rank_killed_alone_leaves_a_died_alone_record_with_every_ranks_host(tmp_path):
    """Rank 2 is node7's first rank, so its record carries every rank's host."""
    pid = _rank(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)")
    (record,) = _ends(tmp_path).values()
    assert {k: v for k, v in record.items() if k != "time"} == {
        "rank": 2, "size": 5, "host": "node7", "pid": pid, "ended": sentinel.ALONE, "hosts": HOSTS}
    assert abs(record["time"] - time.time()) < 600


def test_a_rank_torn_down_with_its_group_leaves_a_torn_down_record(tmp_path):
    """Break guarded: records only for a rank that died alone (a lost node could not be told from anything)."""
    _rank(tmp_path, "", rank=3, group_kill=True)
    (record,) = _ends(tmp_path).values()
    assert record["ended"] == sentinel.TORN_DOWN and record["rank"] == 3
    assert record["hosts"] == HOSTS  # every record carries them (5 ranks <= HOSTS_IN_EVERY)


def test_a_clean_or_reported_end_leaves_no_record_and_a_stale_one_is_removed(tmp_path):
    """A requeued job (same job id, same directory) must not read its earlier run's end."""
    sentinel.leave(str(tmp_path), {"rank": 2, "size": 5, "ended": sentinel.ALONE})
    _rank(tmp_path, "sys.exit(0)")
    assert _ends(tmp_path) == {}
    _rank(tmp_path, "sentinel.quiet(); os._exit(1)")
    assert _ends(tmp_path) == {} and os.listdir(tmp_path) == []


def test_an_unwritable_directory_costs_the_record_only(tmp_path):
    (tmp_path / "file").write_text("")
    _rank(tmp_path / "file" / "d", "os.kill(os.getpid(), signal.SIGKILL)")  # not a directory: nothing written


# ---- the report -------------------------------------------------------------------------------

def _records(hows: dict[int, str], hosts=HOSTS) -> dict[int, dict]:
    out = {}
    for r, how in hows.items():
        out[r] = sentinel.end_record(r, len(hosts), hosts[r], 100 + r, how, 0.0, list(hosts))
    return out


def test_a_lost_host_is_one_none_of_whose_ranks_left_a_record():
    """node7 left nothing while node1's and node9's ranks were torn down. Break guarded: a host counted lost
    when some of its ranks are silent (node9 below)."""
    ends = diagnosis.read_ends(_records({0: sentinel.TORN_DOWN, 1: sentinel.TORN_DOWN, 4: sentinel.TORN_DOWN}))
    assert ends.lost == {"node7": [2, 3]} and ends.silent == [2, 3] and ends.settled()
    text = diagnosis.format_ends(ends)
    assert text.splitlines() == [
        "zerompi end report: 5 ranks, 3 left an end record (their watchers, sentinel.py)",
        "lost: node7 (rank(s) 2-3): none of its ranks left a record, so every process there ended at once, "
        "watchers included (a lost node)",
        "torn down by the launcher: rank(s) 0-1, 4 on node1, node9 (after another rank ended)"]
    partial = diagnosis.read_ends(_records({0: sentinel.TORN_DOWN, 1: sentinel.TORN_DOWN, 2: sentinel.TORN_DOWN}))
    assert partial.lost == {"node9": [4]} and not partial.settled()  # node7's rank 3 may still be writing
    assert "no record: rank(s) 3 on node7 (no watcher, or killed with it)" in diagnosis.format_ends(partial)


def test_a_rank_that_died_alone_is_named():
    ends = diagnosis.read_ends(_records({r: sentinel.TORN_DOWN for r in (0, 1, 2, 4)} | {3: sentinel.ALONE}))
    assert ends.lost == {} and ends.settled()
    assert "died alone: rank(s) 3 on node7 (killed by a signal" in diagnosis.format_ends(ends)


def test_without_the_hosts_nothing_is_called_lost_and_nothing_is_settled():
    """The hosts come from a host's first rank; where no such record is there, silent ranks are only silent."""
    ends = diagnosis.read_ends({r: {"rank": r, "size": 5, "ended": sentinel.TORN_DOWN} for r in (1, 3)})
    assert ends.lost == {} and ends.silent == [0, 2, 4] and not ends.settled()
    assert "no record: rank(s) 0, 2, 4 (no watcher" in diagnosis.format_ends(ends)
    assert not diagnosis.read_ends({}).settled()


def _write(directory: Path, records: dict[int, dict]) -> None:
    for record in records.values():
        sentinel.leave(str(directory), record)


def test_diagnose_prints_the_end_report_where_no_rank_reported(tmp_path, capsys):
    _write(tmp_path, _records({0: sentinel.TORN_DOWN, 1: sentinel.TORN_DOWN, 4: sentinel.TORN_DOWN}))
    assert main(["diagnose", str(tmp_path)]) == 0
    assert "lost: node7 (rank(s) 2-3)" in capsys.readouterr().out


def test_diagnose_prefers_the_hang_report_where_there_is_one(tmp_path, capsys):
    from tests.unit.comm.test_hang import STEP, record
    _write(tmp_path, _records({1: sentinel.TORN_DOWN}))
    diagnosis.write_record(tmp_path, record(0, 2, STEP))
    assert main(["diagnose", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("zerompi hang report") and "end report" not in out


def test_a_node_is_named_lost_from_one_record_of_another_nodes_second_rank(tmp_path, capsys):
    """Under srun a lost node's peer crashed in MPI (rank 1: died alone) and Slurm's step teardown killed rank 0
    with its watcher: rank 1's record alone must name node7 lost (it carries every rank's host). Break guarded:
    hosts in the first rank of each host's record only (the report then named no node)."""
    _write(tmp_path, _records({1: sentinel.ALONE}))
    assert main(["diagnose", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "died alone: rank(s) 1" in out and "lost: node7 (rank(s) 2-3)" in out, out


def test_diagnose_if_unreported_prints_only_what_rank_0_did_not(tmp_path, capsys):
    """What a batch script runs after every failed run: the end report where only watchers' records exist;
    the hang report where ranks left their records but the report was never printed (the reporting rank
    died first: no report.txt); nothing once it was. Break guarded: records alone taken for a printed report
    (a survivor that crashed in the side channel under srun left records and no report)."""
    from tests.unit.comm.test_hang import STEP, record
    _write(tmp_path, _records({0: sentinel.TORN_DOWN, 1: sentinel.TORN_DOWN, 4: sentinel.TORN_DOWN}))
    assert main(["diagnose", "--if-unreported", str(tmp_path)]) == 0
    assert "lost: node7 (rank(s) 2-3)" in capsys.readouterr().out
    diagnosis.write_record(tmp_path, record(0, 2, STEP))
    assert main(["diagnose", "--if-unreported", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("zerompi hang report")
    (tmp_path / diagnosis.REPORT_NAME).write_text("zerompi hang report: ...\n")
    assert main(["diagnose", "--if-unreported", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""


def test_diagnose_without_dir_reads_the_batch_jobs_default_directory(tmp_path, monkeypatch, capsys):
    """No DIR in a batch job: the directory its ranks write to with no hang_dir (the same function names
    both); outside one, a clear error that names the variables it looked for."""
    import tempfile
    from zerompi.comm import watchdog
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for k in watchdog.JOB_VARIABLES:
        monkeypatch.delenv(k, raising=False)
    assert main(["diagnose"]) == 2
    assert "give DIR" in capsys.readouterr().err
    monkeypatch.setenv("PBS_JOBID", "4242.head")
    directory = tmp_path / "zerompi-hang-4242.head"
    directory.mkdir()
    _write(directory, _records({0: sentinel.TORN_DOWN, 1: sentinel.TORN_DOWN, 4: sentinel.TORN_DOWN}))
    assert main(["diagnose"]) == 0
    assert "lost: node7 (rank(s) 2-3)" in capsys.readouterr().out


def test_diagnose_waits_for_the_records_to_settle_and_no_longer(tmp_path, capsys):
    """node1's second record comes 0.5 s late (a watcher slow on a loaded node): --wait reads it, and returns
    as soon as the picture is whole, not at the end of the wait."""
    records = _records({0: sentinel.TORN_DOWN, 1: sentinel.TORN_DOWN, 4: sentinel.TORN_DOWN})
    _write(tmp_path, {r: records[r] for r in (0, 4)})
    late = threading.Timer(0.5, _write, (tmp_path, {1: records[1]}))
    late.start()
    start = time.monotonic()
    try:
        assert main(["diagnose", "--wait", "60", str(tmp_path)]) == 0
    finally:
        late.join()
    assert time.monotonic() - start < 30
    out = capsys.readouterr().out
    assert "lost: node7 (rank(s) 2-3)" in out and "rank(s) 0-1, 4" in out


def test_diagnose_with_nothing_to_read_is_a_clear_error_after_its_wait(tmp_path, capsys):
    start = time.monotonic()
    assert main(["diagnose", "--wait", "0.3", str(tmp_path / "never")]) == 2
    assert time.monotonic() - start >= 0.3
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "end-00000.json").write_text("{not json")  # skipped
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "nor end record (end-*.json)" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [
    "{not json", "[]", '{"rank": "x", "size": 5, "ended": "torn down"}', '{"rank": "3", "size": 5, "ended": "x"}',
    '{"rank": 1, "size": "5", "ended": "torn down"}',
    '{"rank": 7, "size": 5, "ended": "torn down"}', '{"rank": 1, "size": 5}', '{"rank": 1, "size": 5, "ended": 3}',
    '{"rank": 0, "size": 5, "ended": "torn down", "hosts": 7}',
    '{"rank": 0, "size": 5, "ended": "torn down", "hosts": [1, 2, 3, 4, 5]}'])
def test_a_malformed_end_record_is_skipped_not_fatal(tmp_path, capsys, bad):
    """A file that is not what a watcher writes (damaged, or not ours) is left out of the report."""
    _write(tmp_path, _records({0: sentinel.TORN_DOWN, 1: sentinel.TORN_DOWN, 4: sentinel.TORN_DOWN}))
    (tmp_path / "end-00003.json").write_text(bad)
    assert main(["diagnose", str(tmp_path)]) == 0
    assert "lost: node7 (rank(s) 2-3)" in capsys.readouterr().out


@pytest.mark.parametrize("rank, carries", [(0, True), (1, False), (2, True), (4, True)])
def test_beyond_the_cap_each_hosts_first_rank_carries_every_ranks_host(rank, carries, monkeypatch):
    assert "hosts" in sentinel.end_record(rank, 5, HOSTS[rank], 1, sentinel.TORN_DOWN, 0.0, HOSTS)
    monkeypatch.setattr(sentinel, "HOSTS_IN_EVERY", 4)
    record = sentinel.end_record(rank, 5, HOSTS[rank], 1, sentinel.TORN_DOWN, 0.0, HOSTS)
    assert ("hosts" in record) == carries
    assert "hosts" not in sentinel.end_record(0, 5, "node1", 1, sentinel.TORN_DOWN, 0.0, HOSTS[:4])  # incomplete
    json.dumps(record)
