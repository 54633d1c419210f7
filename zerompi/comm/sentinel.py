"""A rank that dies without a word is named by its rank: a small watcher process per rank.

A rank killed by a signal (SIGKILL, the out-of-memory killer) or crashed in native code runs no Python, so
neither the exception hook (guard.py) nor the watchdog can speak for it, and MPICH's launcher names a process
id and host (often another rank's). So each rank starts one watcher, a child that blocks reading a pipe whose
only write end the rank holds. The kernel closes that end however the rank ends; a rank that ends cleanly (at
exit, or in zerompi's own abort, which has reported already) first writes ``QUIET``.

Only the rank that died first may be named, not the ranks the launcher then tears down (MPICH's hydra kills
each rank's process group in the same event that noticed the death). Which came first is decided by the
kernel, not by which process gets a CPU first (a loaded node delays the watcher past the teardown): the
watcher forks a *canary* that stays in the rank's process group and then leaves that group itself. The
read end of the pipe carries ``O_ASYNC`` with the canary as owner and SIGUSR1 (fatal by default) as its
signal, so the kernel, while it closes the rank's end, sends SIGUSR1 to the canary. A fatal signal fixes a
process's exit signal when it is sent, and a later one is dropped; so the canary dies of SIGUSR1 if the rank
ended while its group was untouched (it died alone: the watcher names it), or of SIGKILL if the teardown
reached the group first (the watcher stays silent). The watcher reads the canary's end with ``waitpid``.

For the rank's end to reach the canary before the launcher hears of it, the rank's end of the pipe has a
higher number than every descriptor the rank holds when it starts the watcher, the launcher's (PMI) socket
among them: Linux (5.10 and later) releases a dying process's files from the highest number down. Where it
does not, the launcher can win and the line is missing, never wrong. Linux only (``F_SETSIG``).

Where the rank gives it a directory (``hang_dir``), the watcher also leaves an *end record* there,
``end-NNNNN.json``, for a rank that died alone and for one torn down by the launcher (it outlives the
teardown, in its own session); a clean or reported end leaves none. So after a lost node, whose processes
(watchers too) all died at once, the records say which ranks were torn down and which left nothing, and
``zerompi diagnose`` names the node that left nothing (diagnosis.py ``format_ends``). Each record (beyond
HOSTS_IN_EVERY ranks, the first rank of each host's only) carries every rank's host, which its watcher read from
its standard input at start.

The watcher runs this file by path (``python -I``): standard library only, no torch, no mpi4py, started in
tens of milliseconds. Children a rank forks (DataLoader workers) close their copy of the write end, so a dead
rank's pipe ends when the rank does.
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time

QUIET = b"q"  # the rank ends cleanly (at exit) or through zerompi's abort (which reported it)
TELL = signal.SIGUSR1  # what the closing pipe sends the canary: fatal by default, never sent by launchers
CANARY_WAIT = 60.0  # seconds after the pipe ended: a canary still alive (armed too late) is put down
READY_WAIT = 30.0  # seconds the rank waits for its watcher to be armed (about 0.1 s on an idle node)
HIGH_FD = 4095  # the write end's number at least this (or the open-files limit less one, if lower)
END_GLOB = "end-*.json"  # end records in the rank's directory (diagnosis.py reads them)
HOSTS_IN_EVERY = 512  # up to this many ranks every end record carries every rank's host (a few KB a record)
ALONE, TORN_DOWN = "died alone", "torn down"  # how a rank without a clean end ended, in its end record

_write_end: int | None = None  # this process's end of the pipe, once started
_watcher: subprocess.Popen | None = None


def start(rank: int, size: int, host: str, directory: str | None = None, hosts: tuple[str, ...] = ()) -> None:
    """Start this process's watcher (once; a later call does nothing; nothing where Linux's F_SETSIG is not).
    ``directory``: where the watcher leaves its end record; ``hosts``: every rank's host, for that record."""
    global _write_end, _watcher
    if _write_end is not None or not hasattr(fcntl, "F_SETSIG"):
        return
    read_end, low_end = os.pipe()
    write_end = _above_every_descriptor(low_end)
    ready_read, ready_write = os.pipe()
    try:
        _watcher = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(read_end), str(ready_write), str(rank),
             str(size), host, str(os.getpid()), directory or ""],
            pass_fds=(read_end, ready_write), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    except OSError:  # no watcher: a killed rank is named by the launcher alone, as before
        os.close(write_end)
        os.close(ready_read)
        return
    finally:
        os.close(read_end)
        os.close(ready_write)
    _write_end = write_end
    _tell_hosts(_watcher, hosts)
    _await_ready(ready_read)
    atexit.register(quiet)
    os.register_at_fork(after_in_child=_forget)


def _tell_hosts(watcher: subprocess.Popen, hosts: tuple[str, ...]) -> None:
    """Every rank's host on the watcher's standard input (JSON), which it reads to the end before arming."""
    try:
        watcher.stdin.write(json.dumps(list(hosts)).encode())
        watcher.stdin.close()
    except OSError:  # the watcher is gone already: its records lack the hosts
        pass


def _await_ready(ready_read: int) -> None:
    """Wait (at most READY_WAIT) until the watcher is armed, which it says by closing its end of the ready pipe:
    from then on a death is named."""
    poller = select.poll()
    poller.register(ready_read, select.POLLIN)
    poller.poll(READY_WAIT * 1000)
    os.close(ready_read)


def _above_every_descriptor(fd: int) -> int:
    """``fd`` moved above every descriptor open now (see the module's note), close-on-exec like os.pipe's."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    ceiling = HIGH_FD if soft == resource.RLIM_INFINITY else min(HIGH_FD, soft - 1)
    floor = max(int(name) for name in os.listdir(f"/proc/{os.getpid()}/fd")) + 1
    try:
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, max(floor, ceiling))
    except OSError:
        return fd  # no room up there: the race with the launcher is left to the order it happens in
    os.close(fd)
    return moved


def quiet() -> None:
    """This rank's end needs no line from the watcher: a clean exit, or an abort that reported already."""
    global _write_end
    if _write_end is None:
        return
    try:
        os.write(_write_end, QUIET)
        os.close(_write_end)
    except OSError:
        pass
    _write_end = None


def _forget() -> None:
    """In a forked child: close the inherited write end, which is the rank's alone."""
    global _write_end, _watcher
    if _write_end is not None:
        try:
            os.close(_write_end)
        except OSError:
            pass
    _write_end, _watcher = None, None


def line(rank: int, size: int, host: str, pid: int, when: float) -> str:
    """What the watcher prints for a rank that ended without a clean exit."""
    stamp = time.strftime("%H:%M:%S", time.gmtime(when))
    return (f"zerompi: rank {rank} of {size} (pid {pid} on {host}) ended at {stamp} UTC without a clean exit: "
            "killed by a signal (SIGKILL, the out-of-memory killer) or crashed in native code\n")


def end_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"end-{rank:05d}.json")


def end_record(rank: int, size: int, host: str, pid: int, how: str, when: float, hosts: list[str]) -> dict:
    """What the watcher leaves for a rank that ended without a clean exit, with every rank's host: in each
    record up to HOSTS_IN_EVERY ranks (a node's first rank may be the one whose watcher died with it: Slurm's
    step teardown kills a step's every process, watchers too), beyond that in its host's first rank's only."""
    record = {"rank": rank, "size": size, "host": host, "pid": pid, "ended": how, "time": when}
    if len(hosts) == size and (size <= HOSTS_IN_EVERY or hosts.index(host) == rank):
        record["hosts"] = hosts
    return record


def leave(directory: str, record: dict) -> None:
    """Write ``record`` atomically (a reader never sees half of it); nothing where it cannot be written."""
    path = end_path(directory, record["rank"])
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _read_hosts() -> list[str]:
    try:
        hosts = json.loads(sys.stdin.buffer.read() or b"[]")
    except (OSError, ValueError):
        return []
    return [str(h) for h in hosts] if isinstance(hosts, list) else []


def watch(read_end: int) -> bool:
    """Block until the rank's pipe ends; whether it ended without ``QUIET`` (the rank died)."""
    said = b""
    while chunk := os.read(read_end, 64):
        said += chunk
    return QUIET not in said


def canary(read_end: int, ready: int) -> int:
    """Fork the canary: it stays in this (the rank's) process group until a signal kills it, or until the
    watcher ends (its lifeline pipe then ends: bounded by the watcher's life, itself bounded by the rank's)."""
    lifeline, held = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is for the rank, not a teardown
        os.close(held)
        os.close(read_end)
        os.close(ready)
        os.read(lifeline, 1)
        os._exit(0)
    os.close(lifeline)  # ``held`` stays open for the watcher's life
    return pid


def arm(read_end: int, canary_pid: int) -> None:
    """Let the kernel send TELL to the canary when the rank's end of the pipe closes (or QUIET arrives)."""
    fcntl.fcntl(read_end, fcntl.F_SETOWN, canary_pid)
    fcntl.fcntl(read_end, fcntl.F_SETSIG, TELL)
    fcntl.fcntl(read_end, fcntl.F_SETFL, fcntl.fcntl(read_end, fcntl.F_GETFL) | os.O_ASYNC)


def ended(read_end: int) -> bool:
    """Whether every write end of the pipe is closed already (the rank ended before the canary was armed)."""
    poller = select.poll()
    poller.register(read_end, select.POLLIN)
    return any(events & select.POLLHUP for _, events in poller.poll(0))


def died_alone(canary_pid: int) -> bool:
    """Whether the canary died of TELL: the rank's end closed while its process group was untouched. Called
    once the pipe ended after arming: the canary has a fatal signal pending and ends as soon as it runs."""
    deadline = time.monotonic() + CANARY_WAIT
    while time.monotonic() < deadline:
        pid, status = os.waitpid(canary_pid, os.WNOHANG)
        if pid:
            return os.WIFSIGNALED(status) and os.WTERMSIG(status) == TELL
        time.sleep(0.01)
    _put_down(canary_pid)
    return False


def _put_down(canary_pid: int) -> None:
    try:
        os.kill(canary_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(canary_pid, 0)


def _main(argv: list[str]) -> int:
    read_end, ready, rank, size, host = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    pid, directory = int(argv[5]), argv[6] if len(argv) > 6 else ""
    hosts = _read_hosts()  # before arming: the rank waits for it (its write ends when this read does)
    bird = canary(read_end, ready)
    arm(read_end, bird)
    late = ended(read_end)  # nobody tells the canary of an end that came before arming: say nothing
    try:
        os.setsid()  # out of the rank's process group: a teardown by group reaches the canary, not the watcher
    except OSError:
        pass  # a group leader already (started by hand): nothing to leave
    os.close(ready)  # the rank's wait ends: every write end of the ready pipe is closed (the canary closed its copy)
    if directory:  # a record an earlier run of the same job (a requeue) left for this rank is not this run's
        _remove(end_path(directory, rank))
    if not watch(read_end) or late:
        _put_down(bird)
        return 0
    alone, when = died_alone(bird), time.time()
    if alone:  # else the teardown reached the rank's group first: another rank died first
        try:
            os.write(2, line(rank, size, host, pid, when).encode())
        except OSError:
            pass  # the launcher is gone: nobody to tell
    if directory:
        leave(directory, end_record(rank, size, host, pid, ALONE if alone else TORN_DOWN, when, hosts))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
