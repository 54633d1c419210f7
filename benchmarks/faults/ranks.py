"""Dead and failing ranks in real mpiexec jobs: a rank SIGKILLed, an uncaught exception, a stuck rank.

The jobs run the test suite's worker (run as a script, not imported), so that the benchmark times the very
cases tests/mpi/test_reliability.py judges. Unlike harness.launch.run, these jobs are watched while they
run: the time of a line on stderr, and each rank's process, are what is measured.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from harness import launch
from harness.paths import ROOT

WORKER = ROOT / "tests" / "mpi" / "workers" / "reliability.py"


def _launch(n: int, case: str, out: Path, module: bool = True) -> subprocess.Popen:
    cmd = launch.mpi_command(n, WORKER, "--case", case, "--out", out, abort_on_error=module)
    return subprocess.Popen(cmd, cwd=ROOT, env=launch.job_env(mpich_yield=True), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ", 1)[-1].startswith("Z"))  # zombie: gone


class StderrWatch:
    """Reads a job's stderr, remembering when a line containing ``marker`` first appeared."""

    def __init__(self, proc: subprocess.Popen, marker: str):
        self.marker, self.seen_at, self.text = marker, None, []
        self.thread = threading.Thread(target=self._run, args=(proc,), daemon=True)
        self.thread.start()

    def _run(self, proc) -> None:
        for line in proc.stderr:
            if self.seen_at is None and self.marker in line:
                self.seen_at = time.monotonic()
            self.text.append(line)

    def join(self) -> str:
        self.thread.join(timeout=10)
        return "".join(self.text)


def _end(proc: subprocess.Popen, limit: float) -> tuple[float | None, int | None]:
    """Wait for the job; (end time, return code), or (None, None) after killing it at ``limit``."""
    try:
        proc.wait(timeout=limit)
        return time.monotonic(), proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the job's own process group (start_new_session)
        proc.wait()
        return None, None


def kill_a_rank(n: int, victim: int, tmp: Path) -> dict:
    out = tmp / f"pid-{n}-{victim}-{time.monotonic_ns()}"
    start = time.monotonic()
    proc = _launch(n, "sigkill", out)
    watch = StderrWatch(proc, "\0")
    pid_files = [Path(f"{out}.{r}") for r in range(n)]
    while not all(p.exists() and p.read_text().strip() for p in pid_files):
        if proc.poll() is not None or time.monotonic() - start > 180:
            raise RuntimeError(f"the job did not start: {watch.join()[-2000:]}")
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in pid_files]
    time.sleep(1.0)  # into training
    os.kill(pids[victim], signal.SIGKILL)
    killed = time.monotonic()
    end, rc = _end(proc, 60)
    watch.join()
    time.sleep(0.2)
    return {"ranks": n, "victim": victim, "seconds": None if end is None else end - killed, "rc": rc,
            "all_gone": not any(_alive(p) for p in pids), "startup": killed - 1.0 - start}


def raise_on_a_rank(n: int, tmp: Path) -> dict:
    start = time.monotonic()
    proc = _launch(n, "raise", tmp / f"raise-{n}-{time.monotonic_ns()}.json", module=False)
    watch = StderrWatch(proc, "failed with an uncaught RuntimeError")
    end, rc = _end(proc, 120)
    text = watch.join()
    seen = watch.seen_at
    return {"ranks": n, "seconds": None if end is None or seen is None else end - seen, "rc": rc,
            "reports": text.count("failed with an uncaught RuntimeError: boom on purpose"),
            "total": None if end is None else end - start}


def watchdog(n: int, tmp: Path) -> dict:
    start = time.monotonic()
    proc = _launch(n, "watchdog", tmp / f"wd-{n}-{time.monotonic_ns()}.json")
    watch = StderrWatch(proc, "zerompi watchdog:")
    end, rc = _end(proc, 120)
    watch.join()
    seen = watch.seen_at
    return {"ranks": n, "seconds": None if end is None or seen is None else end - seen, "rc": rc,
            "reported": seen is not None, "total": None if end is None else end - start}


def rank_failures(repeat: int, tmp: Path, log) -> dict:
    kills, raises, dogs = [], [], []
    for n in (2, 3):
        for i in range(repeat):
            victim = (n - 1, 0, 1)[i % 3] % n
            kills.append(kill_a_rank(n, victim, tmp))
            log(f"kill rank {victim} of {n}: {kills[-1]}")
        for _ in range(max(1, repeat - 1)):
            raises.append(raise_on_a_rank(n, tmp))
            log(f"raise on rank {n - 1} of {n}: {raises[-1]}")
    dogs.append(watchdog(2, tmp))
    log(f"watchdog: {dogs[-1]}")
    return {"kills": kills, "raises": raises, "watchdog": dogs}
