"""What mpiexec starts on each rank instead of Python, when tests/mpi/forkserver.py serves: hands this
process's command line, environment, working directory and open files to a fork server that has
torch imported already, and lives as long as the forked process, with its exit status or signal.

``python -I -S rank_python.py SOCKET[,SOCKET...] ARGS...`` runs as ``python ARGS...`` would. Run with
-I -S it imports nothing but the standard library's basics (a few ms): rank r asks server r mod the
number of sockets (each server has its own hash seed, as separate processes would). Where no server
answers or the server declines (another environment, another command-line form), it execs Python.
Signals it receives go to the forked process (all but SIGKILL and SIGSTOP, which cannot be caught); if
this process is killed, the server kills that one. Tests of a rank's death, signals or hangs do not come
here: their ranks start Python (launcher.rank_python(fresh=True)).
"""
import json
import os
import select
import signal
import socket
import struct
import sys

LENGTH = struct.Struct("!Q")  # each message: a length, a pid or a wait status
# variables read at start or import by the interpreter (its locale, the time zone), OpenMP, torch, the
# allocator, HDF5 and the frameworks a server may preload, or read once and kept: ATen's kernel capability
# (at the first kernel, which a preloaded import may run) and tempfile's directory (set by torch's import). A
# rank whose values differ from its server's starts Python (forkserver.py), and a server takes those its
# mpiexec adds for ranks (launcher.py); tests/unit/tools/test_forkserver.py tries each class
SENSITIVE = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "ATEN_", "CUDA", "NVIDIA",
             "LD_", "MALLOC_", "GLIBC_", "HDF5_", "NUMPY_", "LC_", "LANG", "TZ", "TMP", "TEMP",
             "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "SAFETENSORS", "ACCELERATE", "PEFT", "LIGHTNING",
             "PL_", "TQDM")
# read where CUDA starts, not at import (a server never starts CUDA: a fork could not keep it)
READ_LATER = ("CUDA_VISIBLE_DEVICES",)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM, signal.SIGPIPE, signal.SIGTSTP)


def _exec_python(args, mask=None):
    if mask is not None:  # what arrived meanwhile is this process's, as it would be a fresh Python's
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.execv(sys.executable, [sys.executable, *args])


def _open_fds(skip):
    return sorted(int(f) for f in os.listdir("/proc/self/fd") if int(f) != skip and _valid(int(f)))


def _valid(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def recv_exact(sock, n):
    """``n`` bytes from ``sock``, or None if it closes first (forkserver.py reads the same way)."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _wait_status(sock, wake_r):
    """The forked process's wait status from the server; a signal wakes the wait (its handler, which
    forwards it, runs as the select returns) instead of waiting behind a blocking recv."""
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 512)
        if sock in ready:
            return recv_exact(sock, LENGTH.size)


def main():
    sockets, args = sys.argv[1].split(","), sys.argv[2:]
    rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    # a signal sent before the forked process's pid is known waits for it (the rank may already run)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(sockets[rank % len(sockets)])
    except OSError:
        sock.close()
        _exec_python(args, mask)
    fds = _open_fds(sock.fileno())
    request = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}).encode()
    socket.send_fds(sock, [LENGTH.pack(len(request))], fds)
    sock.sendall(request)
    reply = recv_exact(sock, LENGTH.size)
    if reply is None:
        sock.close()
        _exec_python(args, mask)
    pid = LENGTH.unpack(reply)[0]
    if pid == 0:  # declined: run as Python would
        sock.close()
        _exec_python(args, mask)
    # A signal that lands between Python's last look for signals and a blocking recv would wait, unforwarded,
    # until the recv returns, which needs the forked process to end: a SIGTERM sent then left the job
    # hanging. The wakeup fd records it, and the wait below watches that fd beside the socket.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # and those that waited go to it now
    for fd in fds:  # the forked process holds the files now (an inherited pipe stays open until it ends)
        os.close(fd)
    status = _wait_status(sock, wake_r)
    if status is None:
        os._exit(70)  # the server went away without a status
    status = LENGTH.unpack(status)[0]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
