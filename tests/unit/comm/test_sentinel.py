"""The watcher that names a rank that died without a word (zerompi/comm/sentinel.py), in fresh processes: a
process starts its watcher, then ends one way or another; what the watcher printed is read from the process's
standard error (the watcher holds it open until it exits, so reading to its end waits for the watcher).
The job-level check (a rank SIGKILLed under mpiexec, named once by rank): tests/mpi/test_reliability.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerompi.comm import sentinel

ROOT = Path(__file__).resolve().parents[3]
NAMED = re.compile(r"zerompi: rank 2 of 5 \(pid (\d+) on node7\) ended at \d\d:\d\d:\d\d UTC without a clean exit: "
                   r"killed by a signal \(SIGKILL, the out-of-memory killer\) or crashed in native code\n")

# A stand-in rank: no MPI, no torch; it starts its watcher as MPIGroup.start_watchdog does, then ENDING runs.
RANK = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from zerompi.comm import sentinel
sentinel.start(2, 5, "node7")
sentinel.start(2, 5, "node7")  # a second call starts nothing
print(os.getpid(), flush=True)
{ending}
"""


def _run(ending: str, timeout: float = 60.0) -> tuple[str, str, float]:
    """(stdout, stderr, seconds until stderr ended) of a stand-in rank that ends with ``ending``."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", RANK.format(root=str(ROOT), ending=ending)], capture_output=True,
                          text=True, timeout=timeout)
    return proc.stdout, proc.stderr, time.monotonic() - start


def test_a_clean_exit_says_nothing():
    """Break guarded: the exit not marked (every job's end would name every rank)."""
    _, err, _ = _run("sys.exit(0)")
    assert err == ""


def test_an_uncaught_exception_says_nothing_beyond_its_traceback():
    """Python's own exit runs after the traceback: the traceback is the report."""
    _, err, _ = _run("raise RuntimeError('boom')")
    assert "RuntimeError: boom" in err and "zerompi: rank" not in err


def test_a_rank_killed_by_a_signal_is_named_once_with_its_pid():
    """Break guarded: a watcher silent when the pipe ends without the mark."""
    out, err, _ = _run("os.kill(os.getpid(), signal.SIGKILL)")
    assert [int(m) for m in NAMED.findall(err)] == [int(out.split()[0])], err
    assert NAMED.fullmatch(err), err


def test_an_exit_that_skips_pythons_end_is_named_unless_marked_quiet():
    """os._exit (and a crash in native code) skips atexit: named. zerompi's aborts mark the end first
    (MPIGroup.abort calls quiet)."""
    _, err, _ = _run("os._exit(0)")
    assert NAMED.fullmatch(err), err
    _, err, _ = _run("sentinel.quiet(); sentinel.quiet(); os._exit(1)")
    assert err == ""


def test_a_forked_child_does_not_keep_a_dead_ranks_pipe_open(tmp_path):
    """A DataLoader worker forked by the rank lives on after the rank is killed: the watcher still names the
    rank at once, since the child closed its copy of the write end.
    Break guarded: no close in forked children (the line would wait for the child's end, 10 minutes here, and
    the run times out)."""
    pid_file = tmp_path / "child"
    try:
        _, err, _ = _run(f"""
child = os.fork()
if child == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)  # only the watcher holds the stand-in's stderr now
    open({str(pid_file)!r}, "w").write(str(os.getpid()))
    time.sleep(600)
    os._exit(0)
while not os.path.exists({str(pid_file)!r}):
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
""", timeout=90)
        assert NAMED.fullmatch(err), err
    finally:
        if pid_file.exists() and pid_file.read_text():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _torn_down(kill_rank_first: bool) -> str:
    """What the watcher of a stand-in rank printed when its process group was killed (as MPICH's hydra tears a
    job down), with the rank killed alone just before or not. The stand-in leads its own group, as hydra's ranks
    do. The watcher is stopped (SIGSTOP) throughout, as on a loaded node where it gets no CPU before the
    teardown: the verdict may not depend on who runs first."""
    proc = subprocess.Popen([sys.executable, "-c", RANK.format(root=str(ROOT), ending=(
        "print(sentinel._watcher.pid, flush=True)\ntime.sleep(600)"))], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid, watcher = int(proc.stdout.readline()), int(proc.stdout.readline())
        os.kill(watcher, signal.SIGSTOP)
        if kill_rank_first:
            os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=60)  # the rank is gone, its files released; the teardown follows at once
        os.killpg(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        os.kill(watcher, signal.SIGCONT)
        return proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_a_rank_that_died_alone_is_named_though_the_teardown_came_before_its_watcher_ran():
    """Breaks guarded: the watcher in the rank's group (killed with it); the canary not told by the pipe."""
    err = _torn_down(kill_rank_first=True)
    assert NAMED.fullmatch(err), err


def test_a_rank_killed_by_the_teardown_of_its_group_is_not_named():
    """Break guarded: a watcher that names every rank whose pipe ended without the mark (every rank of a torn
    down job would be named, the innocent ones too)."""
    assert _torn_down(kill_rank_first=False) == ""


def _start_in(setup: str, after: str = "") -> str:
    """stdout of a stand-in that runs ``setup``, starts its watcher, prints what ``after`` prints, exits cleanly."""
    code = (f"import os, resource, sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom zerompi.comm import sentinel\n"
            f"{setup}\nbefore = set(os.listdir('/proc/self/fd'))\nsentinel.start(2, 5, 'node7')\n{after}\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "zerompi: rank" not in proc.stderr, proc.stderr
    return proc.stdout


def test_the_write_end_is_the_ranks_one_new_descriptor_above_all_others():
    """What reaches the canary first when the rank dies is the highest descriptor (module note). Breaks guarded:
    the rank keeps the watcher's ends of either pipe open; the write end left where os.pipe put it."""
    out = _start_in("import json", "print(json.dumps(dict(new=sorted(int(f) for f in set(os.listdir('/proc/self/fd'))"
                    " - before), highest=max(int(f) for f in before), end=sentinel._write_end,"
                    " soft=resource.getrlimit(resource.RLIMIT_NOFILE)[0])))")
    got = json.loads(out)
    assert got["new"] == [got["end"]] and got["end"] > got["highest"]
    assert got["end"] == max(got["highest"] + 1, min(sentinel.HIGH_FD, got["soft"] - 1))


def test_under_a_low_open_files_limit_the_write_end_takes_the_last_number():
    """Breaks guarded: the hard limit read for the soft one; a ceiling at or above the limit (no room: the
    pipe stays low, and the kernel's order then no longer favours the watcher)."""
    out = _start_in("resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))",
                    "print(sentinel._write_end)")
    assert int(out) == 63


def test_an_open_descriptor_above_the_ceiling_is_passed():
    """The rank holds a descriptor above HIGH_FD already: the write end goes above it. Break guarded: the floor
    computed below the highest descriptor."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    held = 5000 if hard == resource.RLIM_INFINITY else min(5000, hard - 2)
    if held <= sentinel.HIGH_FD:
        pytest.skip(f"the hard open-files limit ({hard}) leaves no descriptor above HIGH_FD to hold")
    out = _start_in("soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
                    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({held + 2}, hard))\n"
                    f"os.dup2(1, {held})", "print(sentinel._write_end)")
    assert int(out) == held + 1


def test_no_room_above_keeps_the_pipe_where_it_is_and_the_watcher_working():
    """Every number from the ceiling up is taken: the write end stays low, and a clean exit is still silent.
    Break guarded: the low end dropped when it cannot move (every clean exit would be named)."""
    out = _start_in("resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
                    "os.dup2(1, 63)", "print(sentinel._write_end)")
    assert 2 < int(out) < 63


def test_a_watcher_that_cannot_start_leaves_the_rank_as_it_was():
    """No Python to run the watcher (Popen raises): no watcher, no pipe, nothing waited for. Break guarded: the
    start going on as if the watcher had started."""
    out = _start_in("sys.executable = '/nonexistent/python'", "print(sentinel._write_end, sorted(set("
                    "os.listdir('/proc/self/fd')) - before))")
    assert out.split() == ["None", "[]"]


def _standing_rank(setup: str = "") -> tuple[subprocess.Popen, int, int]:
    """A stand-in rank leading its own process group, its watcher started: (process, watcher pid, canary pid)."""
    proc = subprocess.Popen([sys.executable, "-c", RANK.format(root=str(ROOT), ending=(
        f"{setup}\nprint(sentinel._watcher.pid, flush=True)\ntime.sleep(600)"))], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc.stdout.readline()  # the rank's pid
    watcher = int(proc.stdout.readline())
    canary = int(Path(f"/proc/{watcher}/task/{watcher}/children").read_text().split()[0])
    return proc, watcher, canary


def _gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_terminals_interrupt_of_the_group_leaves_the_canary_in_place():
    """^C reaches the rank's whole process group; a rank that handles it goes on, and a later death alone is
    still named. Break guarded: the canary not ignoring SIGINT (it would die of it, and the watcher then
    stay silent for the rank)."""
    proc, _, canary = _standing_rank("signal.signal(signal.SIGINT, lambda *_: None)")
    try:
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert not _gone(canary, within=0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert NAMED.fullmatch(proc.stderr.read())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


def test_the_canary_ends_with_its_watcher():
    """A watcher that dies (killed on its own) takes its canary with it: no process is left in the rank's
    group for the rank's life. Break guarded: the canary keeping the lifeline's write end itself."""
    proc, watcher, canary = _standing_rank()
    try:
        os.kill(watcher, signal.SIGKILL)
        assert _gone(canary)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()


def test_start_returns_once_the_watcher_is_armed_not_after_its_bound():
    """The rank waits for its watcher to be armed (about 0.04 s on an idle machine), never READY_WAIT (30 s).
    Break guarded: a copy of the ready pipe's write end left open in the watcher or the canary (the wait then
    ends only at its bound). The margin is READY_WAIT / 2 against a Python start-up."""
    out = _start_in("import time\nt0 = time.monotonic()", "print(time.monotonic() - t0)")
    assert float(out) < sentinel.READY_WAIT / 2, out


def test_a_watcher_whose_rank_ended_before_it_was_armed_says_nothing_and_ends_at_once(tmp_path):
    """The watcher run by hand on a pipe whose write end is closed already: nobody told the canary, so it has
    nothing to read; it must stay silent and end without waiting out CANARY_WAIT (60 s). Break guarded: the
    late end not seen (the watcher would wait for a canary that never dies). The margin is CANARY_WAIT / 2."""
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    os.close(write_end)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-I", sentinel.__file__, str(read_end), str(ready_write), "2", "5",
                           "node7", "4242"], pass_fds=(read_end, ready_write), capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    took = time.monotonic() - start
    for fd in (read_end, ready_read, ready_write):
        os.close(fd)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert took < sentinel.CANARY_WAIT / 2, took


def test_the_line_says_rank_size_pid_host_and_time():
    assert NAMED.fullmatch(sentinel.line(2, 5, "node7", 4242, 0.0)).group(1) == "4242"
    assert " ended at 00:00:00 UTC " in sentinel.line(2, 5, "node7", 4242, 0.0)


@pytest.mark.parametrize("said,died", [(b"", True), (b"x", True), (sentinel.QUIET, False),
                                       (b"xx" + sentinel.QUIET, False)])
def test_the_watch_reads_to_the_end_and_looks_for_the_mark(said, died):
    read_end, write_end = os.pipe()
    os.write(write_end, said)
    os.close(write_end)
    try:
        assert sentinel.watch(read_end) is died
    finally:
        os.close(read_end)
