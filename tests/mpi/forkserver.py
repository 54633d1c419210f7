"""Ranks that start with torch imported: a fork server for the suite's MPI jobs.

Each rank of a test job used to pay Python's start and a torch import (about 1.3 CPU s; the suite
starts about 600 ranks on 2 cores, so that was a third of its time). A server here imports torch,
numpy and h5py once and waits on a UNIX socket; mpiexec starts ``rank_python.py`` on each rank
instead of Python, which hands the server its command line, environment, working directory and
open files (stdio, and MPICH's PMI_FD); the server forks, the child puts those files at their
numbers, takes the environment and runs the command as ``python`` would, and the launcher's process
waits for it and ends with its status. The ranks are still separate processes started by the real
mpiexec, each calling MPI_Init itself; only the import is shared, copy-on-write.

What could make a forked rank differ from a fresh one is declined, and the rank execs Python as
before: a variable read at start or import, or read once and kept (``SENSITIVE``: the interpreter's,
OpenMP's, torch's, the allocator's, ATen's kernel capability...), that differs from the server's, or a
command line other than ``-m MOD``, ``-c CODE`` or ``SCRIPT``. Another PYTHONPATH is put in sys.path in
place of the server's, unless one of its entries holds a module the server has imported. zerompi
itself is not pre-imported (zerompi.log reads the rank at import). Two servers run, rank r asking
server r mod 2, so neighbouring ranks do not share one hash seed; a hash seed is fixed when an
interpreter starts, so a forked rank keeps its server's for the whole test run (a fresh rank draws its
own). numpy's global generator is reseeded from the OS in each child; Python's ``random`` reseeds
itself at fork. Tests of a rank's death, signals or hangs start Python on each rank instead
(launcher.rank_python(fresh=True)); tests/unit/tools/test_forkserver.py tests this server.

A job may ask for a server that also has its framework imported (``rank_python(preload=("peft",))``):
peft, Lightning and transformers cost 0.5-3.7 CPU s per rank beyond torch. ``-m zerompi.deepspeed``
jobs ask only for what transformers imports that never looks for DeepSpeed (launcher.HF_STACK): the
runner must alias ``deepspeed`` before transformers, accelerate or peft look for it. What a server
imported is frozen (gc.freeze): a child's collections neither visit nor copy it. Off with
``ZEROMPI_TEST_FORKSERVER=0`` (every rank then starts Python); used by tests/mpi/launcher.py.
"""
from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import types
from typing import Callable

from rank_python import LENGTH, READ_LATER, SENSITIVE, recv_exact  # the launcher's side (this folder is on the path)

PRELOAD = ("torch", "numpy", "h5py")
PR_SET_PDEATHSIG = 1
HIGH_FD = 1000  # where received files wait before they move to their numbers


def _die_with_parent(sig: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _form(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """``python ARGV``'s form: ("module" | "code" | "script", what, its arguments), or None (declined)."""
    if len(argv) >= 2 and argv[0] in ("-m", "-c"):
        return ("module" if argv[0] == "-m" else "code"), argv[1], argv[2:]
    if argv and not argv[0].startswith("-"):
        return "script", argv[0], argv[1:]
    return None


def _entries(env) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


# The server's PYTHONPATH entries, where they stand in sys.path (after the script's folder); None if
# Python put them otherwise, and then a rank with another PYTHONPATH is declined.
OWN_PATH = _entries(os.environ) if sys.path[1:1 + len(_entries(os.environ))] == _entries(os.environ) else None
# The environment this server started with, which a rank's must match; what the preloaded imports then
# set (inductor's cache directory) each child gets as a fresh process would, where its rank sets nothing.
STARTED_WITH = dict(os.environ)
ADDED: dict[str, str] = {}


def _same_at_import(env: dict[str, str]) -> bool:
    keys = {k for k in (*env, *STARTED_WITH) if k.startswith(SENSITIVE) and k not in READ_LATER}
    return all(env.get(k) == STARTED_WITH.get(k) for k in keys - {"PYTHONPATH"}) and _path_fits(env)


def _path_fits(env: dict[str, str]) -> bool:
    """Whether the rank's PYTHONPATH can stand in sys.path for the server's (_become puts it there): not
    where one of its new entries holds a module the server has imported (the rank would have found that)."""
    if env.get("PYTHONPATH") == STARTED_WITH.get("PYTHONPATH"):
        return True
    if OWN_PATH is None:
        return False
    imported = {name.partition(".")[0] for name in sys.modules}
    for entry in set(_entries(env)) - set(OWN_PATH):
        try:
            if {name.partition(".")[0] for name in os.listdir(entry)} & imported:
                return False
        except OSError:
            continue
    return True


def _alive(conn: socket.socket) -> bool:
    """False once the launcher's end of ``conn`` has closed (it sends nothing else)."""
    try:
        return bool(conn.recv(1))
    except OSError:
        return False


def _runner(form: tuple[str, str, list[str]], cwd: str) -> Callable[[], None]:
    kind, what, args = form

    def run() -> None:
        if kind == "module":
            sys.argv, sys.path[0] = ["-m", *args], cwd
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        elif kind == "code":  # in a fresh __main__, as ``python -c`` (not among this server's names)
            sys.argv, sys.path[0] = ["-c", *args], ""
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(what, "<string>", "exec"), main.__dict__)
        else:
            sys.argv, sys.path[0] = [what, *args], os.path.dirname(os.path.realpath(what))
            runpy.run_path(what, run_name="__main__")
    return run


def _become(request: dict, received: list[int]) -> None:
    """In the child: the rank's files at their numbers (nothing else open), its environment and directory."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    _die_with_parent(signal.SIGKILL)
    held = [fcntl.fcntl(fd, fcntl.F_DUPFD, HIGH_FD) for fd in received]
    keep = set(held)
    for fd in (int(f) for f in os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for src, dst in zip(held, request["fds"]):
        os.dup2(src, dst, inheritable=True)
    for src in held:
        if src not in request["fds"]:
            os.close(src)
    os.environ.clear()
    os.environ.update({**ADDED, **request["env"]})
    if OWN_PATH is not None:
        sys.path[1:1 + len(OWN_PATH)] = _entries(request["env"])
    os.chdir(request["cwd"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


class Server:
    def __init__(self, path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path + ".part")
        self.listener.listen(64)
        os.rename(path + ".part", path)  # the socket appears once it accepts
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.clients: dict[int, socket.socket] = {}  # child pid -> its launcher's connection

    def serve(self) -> Callable[[], None]:
        """Accept and fork until a child returns here with its work; exit when the test session is gone."""
        parent = os.getppid()
        while True:
            if os.getppid() != parent:
                sys.exit(0)
            socks = {s.fileno(): (pid, s) for pid, s in self.clients.items()}
            for fd in select.select([self.listener.fileno(), self.wake_r, *socks], [], [], 1.0)[0]:
                if fd == self.wake_r:
                    self._reap()
                elif fd == self.listener.fileno():
                    work = self._accept()
                    if work is not None:
                        return work
                elif fd in socks and not _alive(socks[fd][1]):  # the launcher's process is gone
                    try:
                        os.kill(socks[fd][0], signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def _accept(self) -> Callable[[], None] | None:
        conn, _ = self.listener.accept()
        body, received = None, []
        try:
            head, received, _, _ = socket.recv_fds(conn, LENGTH.size, 64)
            body = recv_exact(conn, LENGTH.unpack(head)[0]) if len(head) == LENGTH.size else None
        except OSError:
            pass
        request = json.loads(body) if body else None
        form = _form(request["argv"]) if request else None
        if request is None or form is None or not _same_at_import(request["env"]) \
                or len(received) != len(request["fds"]):
            for fd in received:
                os.close(fd)
            try:
                conn.sendall(LENGTH.pack(0))
            except OSError:
                pass
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # the server's sockets must not close, when collected, whatever file the rank has at their numbers
            for sock in (self.listener, conn, *self.clients.values()):
                sock.detach()
            _become(request, received)
            return _runner(form, request["cwd"])
        for fd in received:
            os.close(fd)
        self.clients[pid] = conn
        try:
            conn.sendall(LENGTH.pack(pid))
        except OSError:  # the launcher's process died meanwhile
            os.kill(pid, signal.SIGKILL)
        return None

    def _reap(self) -> None:
        while True:
            try:
                os.read(self.wake_r, 4096)
            except BlockingIOError:
                break
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.clients.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(LENGTH.pack(status))
                except OSError:
                    pass
                conn.close()


def main() -> None:
    path, extra = sys.argv[1], [m for m in sys.argv[2:3] for m in m.split(",") if m]
    for name in (*PRELOAD, *extra):  # "-NAME" in the extra modules leaves NAME out
        if not name.startswith("-") and f"-{name}" not in extra:
            __import__(name)
    ADDED.update((k, v) for k, v in os.environ.items() if STARTED_WITH.get(k) != v)
    if threading.active_count() > 1:  # a fork keeps only this thread: a library's own would be lost
        raise SystemExit(f"forkserver: importing {extra} started threads; not serving")
    # what is imported stays out of every child's collections: a collection writes to each object it
    # visits, which would copy the shared pages into every rank (and cost more, the more is preloaded)
    gc.freeze()
    work = Server(path).serve()
    del sys.argv[1:]
    work()


if __name__ == "__main__":
    main()
