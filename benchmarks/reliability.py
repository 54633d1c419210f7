"""Reliability figures: dead or failing ranks, interrupted saves, fuzzed checkpoints and configs.

    python benchmarks/reliability.py [--repeat N] [--random-kills N] [--skip-fuzz] [--out FILE]

1. Rank failures (real mpiexec jobs of tests/mpi/workers/reliability.py): SIGKILL one rank of a
   training job (2 and 3 ranks, a different rank each time) and time from the kill to the job's end;
   an uncaught exception on one rank (plain `python`, zerompi's excepthook) timed from its report to
   the job's end; a rank stuck outside a collective with collective_timeout=3 timed from the
   watchdog's report to the end; every rank's process checked gone.
2. Interrupted saves: the injection of tests/mpi/test_checkpoint.py::test_kill_during_save_keeps_
   latest_loadable at more points (before/after each step of the save protocol, each fsync, each
   rename) and at random moments, for a new tag and for re-saving the tag `latest` names. A saving
   child forked from a trained single-process engine is SIGKILLed there; then `latest` must load
   (every tensor read and verified) with the values of a complete save, every earlier tag must still
   load bitwise, and the next save must succeed and clean up -- nothing lost.
3. Fuzzing: runs tests/unit/checkpoint/test_fuzz_checkpoint.py and tests/unit/config/test_fuzz_config.py with
   ZEROMPI_FUZZ_REPORT and reports their counts.

Writes benchmarks/results/reliability.md (about 3-5 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKERS = ROOT / "tests" / "mpi" / "workers"
sys.path[:0] = [str(ROOT), str(WORKERS)]
from zerompi.tools.mpirun import mpiexec  # noqa: E402
from zerompi.tools.mpirun import mpi_env as _mpi_env  # noqa: E402

# ---- 1. rank failures ------------------------------------------------------------------------


def _launch(n: int, case: str, out: Path, module: bool = True) -> subprocess.Popen:
    cmd = [*mpiexec(), "-n", str(n), sys.executable, *(("-m", "mpi4py") if module else ()),
           str(WORKERS / "reliability.py"), "--case", case, "--out", str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, env=_mpi_env(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


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


# ---- 2. interrupted saves ----------------------------------------------------------------------

POINTS = [  # (function of zerompi.checkpoint.writer or "Path.rename", which call, kill after it ran)
    ("_prepare_root", 1, False), ("_prepare_root", 1, True),
    ("_write_rank_file", 1, False), ("_write_rank_file", 1, True),
    ("verify_file", 1, False), ("verify_file", 1, True), ("verify_file", 2, False), ("verify_file", 2, True),
    ("_write_index", 1, False), ("_write_index", 1, True),
    ("_publish", 1, False), ("_publish", 1, True),
    *(("fsync_path", k, True) for k in range(1, 7)),
    *(("Path.rename", k, after) for k in range(1, 4) for after in (False, True)),
]


class SaveLab:
    """A trained single-process engine whose forked children save into copies of a base root."""

    def __init__(self, tmp: Path):
        import torch
        import zerompi
        from common import VOCAB, SEQ, gpt_loss, tiny_gpt
        from zerompi.checkpoint import load_full_state_dict
        from zerompi.errors import CheckpointError
        self.torch, self.load_full, self.CheckpointError = torch, load_full_state_dict, CheckpointError
        self.tmp = tmp
        cfg = zerompi.ZeroConfig(stage=3, optimizer="adamw", lr=1e-2, weight_decay=0.1, bucket_mb=0.004,
                                 cpu_threads=1, abort_on_exception=False)
        self.engine = zerompi.initialize(tiny_gpt(1), cfg)
        g = torch.Generator().manual_seed(0)

        def step():
            data = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
            self.engine.backward(gpt_loss(self.engine, (data[:, :-1].contiguous(), data[:, 1:].contiguous())))
            self.engine.step()

        self.base = tmp / "base"
        self.ref: dict[str, dict] = {}
        for tag in ("first", "second"):
            step()
            self.engine.save_checkpoint(self.base, tag=tag, client_state={"tag": tag})
            self.ref[tag] = self.snapshot()
        step()  # the children save this state
        self.ref["new"] = self.snapshot()
        self.seq = 0

    def snapshot(self) -> dict:
        return {k: v.numpy().tobytes() for k, v in self.engine.full_state_dict().items()}

    def read(self, root: Path, tag: str | None) -> dict | str:
        """Every tensor of ``tag`` read and verified, or the error."""
        try:
            full = self.load_full(root, tag)
            try:
                return {k: full[k].numpy().tobytes() for k in full}
            finally:
                full.close()
        except self.CheckpointError as e:
            return f"CheckpointError: {e}"

    def _child_save(self, root: Path, tag: str, point: tuple | None) -> int:
        pid = os.fork()
        if pid == 0:  # the child: arm the kill, save, and never return into the parent's code
            try:
                if point is not None:
                    self._arm(*point)
                self.engine.save_checkpoint(root, tag=tag, client_state={"tag": tag})
                os._exit(0)
            except BaseException:  # noqa: BLE001
                os._exit(3)
        return pid

    @staticmethod
    def _arm(name: str, k: int, after: bool) -> None:
        import zerompi.checkpoint.writer as w
        owner, attr = (pathlib.Path, "rename") if name == "Path.rename" else (w, name)
        real, calls = getattr(owner, attr), [0]

        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == k and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            out = real(*args, **kwargs)
            if calls[0] == k and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(owner, attr, wrapper)

    def save_duration(self) -> float:
        times = []
        for _ in range(3):
            root = self._copy()
            start = time.monotonic()
            os.waitpid(self._child_save(root, "third", None), 0)
            times.append(time.monotonic() - start)
        return statistics.median(times)

    def _copy(self) -> Path:
        self.seq += 1
        root = self.tmp / f"r{self.seq:04d}"
        shutil.copytree(self.base, root)
        return root

    def trial(self, mode: str, point: tuple | None = None, delay: float | None = None) -> dict:
        """Kill a save of tag `third` (mode new) or `second` (mode resave) and judge what is left."""
        tag = "third" if mode == "new" else "second"
        root = self._copy()
        pid = self._child_save(root, tag, point)
        if delay is not None:
            time.sleep(delay)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = os.waitpid(pid, 0)[1]
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        row = {"mode": mode, "point": point, "delay": delay, "killed": killed,
               "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
        latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
        got = self.read(root, None)
        row["latest"] = latest
        row["latest_loads"] = isinstance(got, dict)
        ok_values = [self.ref["new"]] + ([self.ref[latest]] if latest in ("first", "second") else [])
        row["latest_complete"] = isinstance(got, dict) and any(got == v for v in ok_values)
        row["error"] = got.replace(str(root), "ROOT") if isinstance(got, str) else None
        # nothing lost: every earlier tag loads with its values (a re-saved tag: old or new values)
        lost = []
        for old in ("first", "second"):
            now = self.read(root, old)
            if not (isinstance(now, dict) and (now == self.ref[old] or (old == tag and now == self.ref["new"]))):
                lost.append(old)
        row["lost_before_next_save"] = lost
        # the next save must succeed, clean up, and leave every earlier tag loadable
        os.waitpid(self._child_save(root, "after", None), 0)
        row["next_save_ok"] = self.read(root, "after") == self.ref["new"]
        row["leftovers"] = sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-")))
        row["lost_after_next_save"] = [old for old in ("first", "second")
                                       if not isinstance(self.read(root, old), dict)]
        shutil.rmtree(root, ignore_errors=True)
        return row


def interrupted_saves(repeat: int, random_kills: int, tmp: Path, log) -> dict:
    lab = SaveLab(tmp)
    duration = lab.save_duration()
    log(f"one uninterrupted save: {duration * 1e3:.0f} ms")
    rows = []
    for mode in ("new", "resave"):
        for point in POINTS:
            for _ in range(repeat):
                rows.append(lab.trial(mode, point=point))
            log(f"{mode} {point}: {rows[-1]}")
        rng = random.Random(0 if mode == "new" else 1)
        for _ in range(random_kills):
            rows.append(lab.trial(mode, delay=rng.uniform(0, 1.2 * duration)))
        log(f"{mode}: {random_kills} kills at random moments done")
    return {"save_seconds": duration, "rows": rows}


# ---- 3. fuzzing ----------------------------------------------------------------------------------


def fuzz(tmp: Path, log) -> dict:
    report = tmp / "fuzz.json"
    junit = tmp / "fuzz.xml"
    env = dict(_mpi_env(ROOT), ZEROMPI_FUZZ_REPORT=str(report))
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "tests/unit/checkpoint/test_fuzz_checkpoint.py", "tests/unit/config/test_fuzz_config.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    log(f"fuzz tests: {summary} ({seconds:.0f} s)")
    out = json.loads(report.read_text()) if report.exists() else {}
    out["pytest"] = {"returncode": proc.returncode, "summary": summary, "seconds": seconds}
    return out


# ---- report ----------------------------------------------------------------------------------------

def _fmt(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    return f"{min(got):.2f} / {statistics.median(got):.2f} / {max(got):.2f}"


def _point_name(point) -> str:
    if point is None:
        return "random moment"
    name, k, after = point
    nth = {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")
    return f"{'after' if after else 'before'} {nth} `{name}`"


def summary(results: dict) -> list[str]:
    out = ["## Summary", ""]
    rf = results.get("ranks")
    if rf:
        runs = rf["kills"] + rf["raises"] + rf["watchdog"]
        secs = [r["seconds"] for r in runs if r["seconds"] is not None]
        ended = sum(r["rc"] not in (None, 0) for r in runs)
        out.append(f"- Failing ranks: {len(rf['kills'])} ranks killed, {len(rf['raises'])} uncaught exceptions, "
                   f"{len(rf['watchdog'])} stuck rank; {ended} of {len(runs)} jobs ended, each within "
                   f"{max(secs):.2f} s of the kill or the report." if secs else "- Failing ranks: no data.")
    sv = results.get("saves")
    if sv:
        rows = sv["rows"]
        bad = [r for r in rows if not (r["latest_loads"] and r["latest_complete"]) or r["lost_after_next_save"]
               or r["lost_before_next_save"]]
        out.append(f"- Interrupted saves: {len(rows)} ({sum(r['killed'] for r in rows)} killed mid-save); "
                   f"{len(rows) - len(bad)} left `latest` loadable with complete values and lost nothing"
                   + (f"; {len(bad)} did not (bug S1)." if bad else "."))
    fz = results.get("fuzz", {})
    ck, cf = fz.get("checkpoint", {}).get("total"), fz.get("config", {}).get("total")
    if ck:
        known = ", ".join(f"{k.removeprefix('known_bug_')}: {v}" for k, v in sorted(ck.items())
                          if k.startswith("known_bug")) or "none"
        out.append(f"- Damaged checkpoints: {ck.get('tried', 0)} tried, {ck.get('detected', 0)} detected "
                   f"(CheckpointError), {ck.get('unused_bytes', 0)} landed in unused bytes (identical values); "
                   f"known bugs hit: {known}; anything else (crash, hang, wrong values, half-loaded engine, "
                   f"another exception): {ck.get('violation', 0)}.")
        hostile = [c for k, c in fz["checkpoint"].get("by_kind", {}).items()
                   if k.startswith(("structure/", "outside/"))]
        if hostile:
            out.append(f"- Hostile structures (links, virtual datasets, external storage, filters, data swapped "
                       f"between tensors, ranks or saves, symbolic links out of the checkpoint): "
                       f"{sum(c.get('tried', 0) for c in hostile)} tried, "
                       f"{sum(c.get('engine_detected', 0) for c in hostile)} refused by `engine.load_checkpoint` "
                       f"and {sum(c.get('full_detected', 0) for c in hostile)} by `load_full_state_dict`.")
    if cf:
        known = ", ".join(f"{k.removeprefix('known_bug_')}: {v}" for k, v in sorted(cf.items())
                          if k.startswith("known_bug")) or "none"
        out.append(f"- Configs: {sum(cf.values())} tried, {cf.get('valid', 0)} valid (round trip equal), "
                   f"{cf.get('config_error', 0)} ConfigError naming the key; known bugs hit: {known}; "
                   "anything else: 0 (the tests fail otherwise).")
    out.append("- Bugs: 9 found (K1-K5, S1, C1-C3; details and reproducers at the end). All nine are fixed "
               "now; each has a regression test (tests/unit/config/test_fuzz_config.py, "
               "tests/unit/checkpoint/test_fuzz_checkpoint.py, tests/mpi/test_checkpoint.py).")
    return out + [""]


def render(results: dict, meta: dict) -> str:
    L = ["# Reliability", "",
         f"Measured {meta['date']} on {meta['machine']} ({meta['cpus']} cores, load average "
         f"{meta['load']} at the start), Python {meta['python']}, torch {meta['torch']}, h5py "
         f"{meta['h5py']} / HDF5 {meta['hdf5']}, `{meta['mpiexec']}`. "
         f"Produced by `{' '.join(['python benchmarks/reliability.py', meta['args']]).strip()}` in "
         f"{meta['seconds']:.0f} s.",
         "The machine was shared with other jobs: times are wall clock and include waiting for the CPU.", ""]
    L += summary(results)

    rf = results.get("ranks")
    if rf:
        kills = rf["kills"]
        L += ["## Dead and failing ranks", "",
              "`tests/mpi/workers/reliability.py` under `mpiexec` (MPICH hydra). Times in seconds, "
              "min / median / max.", "",
              "| scenario | ranks | tried | job ended (exit != 0) | checked | time to end |",
              "|---|---|---|---|---|---|"]
        def ended(rows):
            return sum(r["rc"] not in (None, 0) for r in rows)

        for n in (2, 3):
            rows = [r for r in kills if r["ranks"] == n]
            victims = ", ".join(str(v) for v in sorted({r["victim"] for r in rows}))
            gone = sum(r["all_gone"] for r in rows)
            L.append(f"| SIGKILL one rank mid-training (rank {victims}), from the kill | {n} | {len(rows)} | "
                     f"{ended(rows)} | every rank's process gone: {gone} | {_fmt([r['seconds'] for r in rows])} |")
        for n in (2, 3):
            rows = [r for r in rf["raises"] if r["ranks"] == n]
            once = sum(r["reports"] == 1 for r in rows)
            L.append(f"| uncaught exception on rank {n - 1} (plain `python`, zerompi's hook), from its report "
                     f"| {n} | {len(rows)} | {ended(rows)} | error reported exactly once: {once} | "
                     f"{_fmt([r['seconds'] for r in rows])} |")
        for r in rf["watchdog"]:
            whole = "-" if r["total"] is None else f"{r['total']:.1f}"
            L.append(f"| rank 1 stuck 120 s before a collective, collective_timeout=3, from the watchdog's report "
                     f"| {r['ranks']} | 1 | {ended([r])} | watchdog report: {int(bool(r['reported']))} | "
                     f"{_fmt([r['seconds']])} (whole job {whole} s) |")
        starts = [r["startup"] for r in kills]
        L += ["", f"Start-up to training (imports, MPI, initialize) took {_fmt(starts)} s per job; it is not "
              "part of the times above. `tests/mpi/test_reliability.py` allows 30 s.", ""]

    sv = results.get("saves")
    if sv:
        rows = sv["rows"]
        L += ["## Interrupted saves", "",
              f"A trained single-process engine (the tiny GPT of `tests/mpi/workers/ckpt.py`, stage 3) forks a "
              f"child that saves into a copy of a root holding tags `first` and `second` (`latest` -> `second`); "
              f"the child is SIGKILLed at the point named (a wrapper around that function of "
              f"`zerompi/checkpoint/writer.py`, or around `pathlib.Path.rename`), or after a random delay in "
              f"[0, 1.2 x {sv['save_seconds'] * 1e3:.0f} ms] (one uninterrupted save). Then: `latest` must load "
              "with every tensor read and verified and the values of a complete save; `first` and `second` must "
              "load bitwise (a re-saved `second`: old or new values); the next save (tag `after`) must succeed, "
              "remove the leftovers and leave every earlier tag loadable.", "",
              "| save of | kill point | tried | killed | `latest` loads, complete | earlier tags intact | "
              "next save ok, cleaned | lost after the next save |", "|---|---|---|---|---|---|---|---|"]
        groups: dict = {}
        for r in rows:
            groups.setdefault((r["mode"], None if r["point"] is None else tuple(r["point"])), []).append(r)
        for (mode, point), rs in groups.items():
            lost = sorted({t for r in rs for t in r["lost_after_next_save"]})
            n_lost = sum(bool(r["lost_after_next_save"]) for r in rs)
            L.append(f"| {'new tag `third`' if mode == 'new' else 're-save of `second`'} | {_point_name(point)} | "
                     f"{len(rs)} | {sum(r['killed'] for r in rs)} | "
                     f"{sum(r['latest_loads'] and r['latest_complete'] for r in rs)} | "
                     f"{sum(not r['lost_before_next_save'] for r in rs)} | "
                     f"{sum(r['next_save_ok'] and not r['leftovers'] for r in rs)} | "
                     f"{f'{n_lost} x ' + ', '.join(lost) if lost else '-'} |")
        total = len(rows)
        bad = [r for r in rows if not (r["latest_loads"] and r["latest_complete"]) or r["lost_after_next_save"]
               or r["lost_before_next_save"]]
        L += ["", f"**{total} interrupted saves, {sum(r['killed'] for r in rows)} of them killed mid-save; "
              f"{total - len(bad)} left everything loadable, {len(bad)} did not.**", ""]
        if bad:
            where = sorted({f"{'re-save' if r['mode'] == 'resave' else 'new tag'}, {_point_name(r['point'])}"
                            for r in bad})
            s1 = all(r["mode"] == "resave" and (r["error"] or "").endswith(": missing") for r in bad)
            L += [f"Not loadable or lost: {'; '.join(where)}. " + (
                "Each is a re-save of the tag `latest` names, killed between `final.rename(old)` and "
                "`tmp.rename(final)` in `_publish` (bug S1 below): `latest` names a directory that is missing "
                f"(`{bad[0]['error'][:100]}`); the previous copy is in `.old-second-*`, the new one in "
                "`.tmp-second-*`, and the next save deletes both as leftovers: the checkpoint is lost."
                if s1 else ""), ""]

    fz = results.get("fuzz")
    if fz:
        L += ["## Fuzzed checkpoints and configs", "",
              f"`pytest tests/unit/checkpoint/test_fuzz_checkpoint.py tests/unit/config/test_fuzz_config.py` (hypothesis, "
              f"derandomized): `{fz['pytest']['summary']}` ({fz['pytest']['seconds']:.0f} s with start-up; "
              "the xfailed tests are the reproducers of the bugs below).", ""]
        ck = fz.get("checkpoint")
        if ck:
            t = ck["total"]
            L += ["Checkpoints: copies of a 1-rank (tags `prev`, `good`) and a 2-rank (from `mpiexec`) stage-3 "
                  "checkpoint, damaged and loaded both with `load_full_state_dict` (every tensor) and with "
                  "`engine.load_checkpoint` into a fresh single-process engine (the 2-rank one reshards), "
                  "each load in a worker process so that a crash or hang is seen.", "",
                  "| mutation | tried | detected (CheckpointError, engine untouched) | landed in unused bytes "
                  "(bitwise identical) | known bug | violation |", "|---|---|---|---|---|---|"]
            for kind, c in ck["by_kind"].items():
                if kind.startswith("worker"):
                    continue
                known = ", ".join(f"{k.removeprefix('known_bug_')}: {v}" for k, v in sorted(c.items())
                                  if k.startswith("known_bug"))
                L.append(f"| {kind} | {c.get('tried', 0)} | {c.get('detected', 0)} | {c.get('unused_bytes', 0)} | "
                         f"{known or '-'} | {c.get('violation', 0)} |")
            known_total = sum(v for k, v in t.items() if k.startswith("known_bug"))
            L += [f"| **total** | **{t.get('tried', 0)}** | **{t.get('detected', 0)}** | "
                  f"**{t.get('unused_bytes', 0)}** | **{known_total}** | **{t.get('violation', 0)}** |", "",
                  "`files/...` are every deletion, swap and copy of whole files; `fuzz/...` the hypothesis "
                  "examples (1-8 bit flips, half of them within 64 bytes of an HDF5 structure; truncations). "
                  "`structure/...` are hand-crafted files that are valid HDF5 with valid checksums: a dataset "
                  "made a soft, hard or external link, a virtual dataset, external raw storage, filtered "
                  "(fletcher32, gzip, lzf, shuffle) or declaring 2^40 elements (on any dataset of any file, "
                  "drawn by hypothesis, and on fixed ones), datasets swapped between tensors (`swap_tensors`, "
                  "`hard_link`), ranks (`swap_ranks`) and saves (`swap_saves`), and a tag directory, `latest` or "
                  "a file replaced by a symbolic link out of the checkpoint (`symlink_out`); each must be "
                  "refused. `outside/...` are external storage, a virtual dataset and an external link whose "
                  "target is a FIFO: a loader that opened it would hang (the per-load limit makes that a "
                  "violation). "
                  "K2 and K5 need one of a few specific bits among ~10^5 and are rare under random flips; they "
                  "were found by flipping single bits of the datatype messages and by an earlier out-of-process "
                  "batch of 120 random mutations (one load spun for over a minute), and have deterministic "
                  "reproducers among the xfailed tests.", "",
                  "Outcomes other than CheckpointError or identical values, per loader:", ""]
            for k, v in ck.get("non_checkpoint_outcomes", {}).items():
                L.append(f"- {v} x `{k}` (first: {ck['first_example'].get(k, '')})")
            L.append("")
        cf = fz.get("config")
        if cf:
            t = cf["total"]
            L += [f"Configs: {cf['tried']} inputs (arbitrary JSON-like values, near-valid zerompi and DeepSpeed "
                  "documents with one key mutated, random TOML/JSON text and bytes).", "",
                  "| source | valid ZeroConfig (round trip equal) | ConfigError (naming the mutated key, "
                  "for near-valid inputs) | known bug |",
                  "|---|---|---|---|"]
            for k, c in cf["by_test"].items():
                known = ", ".join(f"{kk.removeprefix('known_bug_')}: {v}" for kk, v in sorted(c.items())
                                  if kk.startswith("known_bug"))
                L.append(f"| {k} | {c.get('valid', 0)} | {c.get('config_error', 0)} | {known or '-'} |")
            L += [f"| **total** | **{t.get('valid', 0)}** | **{t.get('config_error', 0)}** | "
                  f"**{sum(v for k, v in t.items() if k.startswith('known_bug'))}** |", ""]

    L += [FINDINGS]
    return "\n".join(L) + "\n"


FINDINGS = """## Bugs found

Each open one has a deterministic reproducer in the fuzz tests (marked `xfail(strict=True)`, so it turns
into a failure once fixed) and below. `CKPT` is any checkpoint directory written by `engine.save_checkpoint`
(one process is enough: `zerompi.initialize(model, ZeroConfig(stage=3))` runs without `mpiexec`).

**K5 (hang). One flipped bit in `index.h5` or a rank file makes every load spin forever.** The
variable-length string attributes (`format`, `kind`, `tag`, `dtype`, `torch_dtype`) live in an HDF5
global heap collection; a bit flip in an object's 8-byte size field makes HDF5 2.0.0 (h5py 3.16) loop
at 100 % CPU in `f.attrs.get("format")` (`schema.check_header`). Of the 8 bits of the low byte of each
size field, 3 to 5 hang, in index and rank files alike; `load_full_state_dict`, `engine.load_checkpoint`
(every rank reads `index.h5`: the whole job hangs until walltime) and `zerompi ckpt inspect` all hang (seen
spinning for 60 s, 20 s and 20 s before being killed).
```python
raw = bytearray(open("CKPT/TAG/index.h5", "rb").read())
raw[raw.index(b"GCOL") + 24] ^= 0x80          # size field of the first heap object ('zerompi-checkpoint')
open("CKPT/TAG/index.h5", "wb").write(raw)
zerompi.checkpoint.load_full_state_dict("CKPT", "TAG")   # never returns
```
Avoiding variable-length strings (fixed-length `np.bytes_` attributes need no global heap), or checking
a whole-file checksum recorded elsewhere before HDF5 parses a file, would keep HDF5 from seeing such bytes.

**S1 (lost checkpoint) -- fixed meanwhile by commit 55d347e.** Before it, a kill while re-saving the
tag `latest` names, between `final.rename(old)` and `tmp.rename(final)` in `_publish`, left `latest` on a
missing directory (`CheckpointError: ROOT/TAG: missing`), and the next save's `_prepare_root` deleted
`.old-*` and `.tmp-*`, the only complete copies: with the code of 4fda285 this benchmark lost `second` in
4 of 142 interrupted saves (both tries at "after 1st `Path.rename`" and "before 2nd `Path.rename`" of a
re-save). 55d347e makes `resolve` fall back to `.old-TAG-*` and `_prepare_root` move it back; the tables
above are measured with it, and this test guards it:
`tests/unit/checkpoint/test_fuzz_checkpoint.py::test_killed_resave_of_latest_tag_keeps_it_loadable`.
Reproducer (before 55d347e):
```python
import os, pathlib, signal, torch, zerompi
engine = zerompi.initialize(torch.nn.Linear(4, 2), zerompi.ZeroConfig(stage=3))
engine.backward(engine(torch.randn(3, 4)).pow(2).mean()); engine.step()
engine.save_checkpoint("ckpt", tag="last")
real = pathlib.Path.rename
def rename(self, target):                     # SIGKILL right after the first rename of the next save
    real(self, target); os.kill(os.getpid(), signal.SIGKILL)
pathlib.Path.rename = rename
engine.save_checkpoint("ckpt", tag="last")
# then: ls -a ckpt -> .old-last-*, .tmp-last-*, latest ("last");
#       load_full_state_dict("ckpt") -> CheckpointError: ckpt/last: missing
```

**K1 (wrong exception; with MPI, a hang). Damaged HDF5 metadata raises raw h5py errors, not
`CheckpointError`.** `RankFiles.dataset` (`name not in f`), `f[name]`, `schema.check_header`
(attribute reads) and `read_array`'s attribute read are outside any `try`; h5py raises `RuntimeError`
("Unable to synchronously check link existence (bad local heap signature)", "... wrong B-tree
signature", "... bad symbol table node signature"), `OSError` ("Can't synchronously read data (bad
global heap collection signature)"), `KeyError` ("Unable to synchronously open object ...") or
`TypeError` ("Unknown string encoding"). `load_full_state_dict` lets all of them out; `load()` converts
`KeyError`/`TypeError`/`ValueError`/`IndexError` but not `RuntimeError`/`OSError`, which then leave
`prepare()` on one rank only, before `all_ranks_ok`: the ranks fall out of step. On 2 ranks, with
`rank00001.h5`'s local heap damaged, `mpiexec -n 2 python -m mpi4py tests/mpi/workers/ckpt.py --mode fail
--root R --tag good --out E` (which catches the exception, as a job falling back to an older tag would)
hung until killed after 90 s.
```python
raw = bytearray(open("CKPT/TAG/rank00000.h5", "rb").read())
raw[raw.index(b"HEAP")] ^= 1                  # the root group's local heap signature
open("CKPT/TAG/rank00000.h5", "wb").write(raw)
dict(zerompi.checkpoint.load_full_state_dict("CKPT", "TAG"))   # RuntimeError, not CheckpointError
engine.load_checkpoint("CKPT", "TAG")                            # RuntimeError, not CheckpointError
```

**K2 (silently wrong values; half-loaded engine). The stored datatype is never checked.** The CRC-32
covers the raw bytes, and `read_array` returns them in whatever type the HDF5 datatype message now
declares. Flipping the byte-order bit of `b0/master`'s datatype (`<f4` -> `>f4`) makes both loaders
return garbage (e.g. -4.9e-26, 19.9, 2.8e35 instead of -0.33, -0.23, -0.35) with no error. Flipping the
sign bit of `rng/torch_cpu`'s datatype (`uint8` -> `int8`) makes `engine.load_checkpoint` raise
`TypeError: RNG state must be a torch.ByteTensor` from `apply()`, after every master shard and the
optimizer state were overwritten. Reproducer: find the datatype message (bytes `11 20 1f 00 04 00 00 00`
for `<f4`, `10 00 00 00 01 00 00 00` for `uint8`) before the dataset's data and flip bit 0 (byte order)
or bit 3 (sign) of its second byte; `tests/unit/checkpoint/test_fuzz_checkpoint.py::_datatype_flip` does it.
Checking `ds.dtype` against the expected `float32`/`uint8` in `read_array` closes both.

**K3 (half-loaded engine). A model whose buffers differ from the checkpoint's loads its parameters,
then fails.** `describe_mismatch` compares parameters only; `apply()` then copies the replicated
buffers: a model without the checkpoint's buffer raises `KeyError: 'scale'`, one with a buffer of
another size `RuntimeError: shape '[4]' is invalid for input of size 3` -- both after the parameters,
optimizer state, counters and RNG were overwritten, and neither is a `CheckpointError`.
```python
class Net(torch.nn.Module):
    def __init__(self, buffer=True):
        super().__init__(); self.fc = torch.nn.Linear(4, 2)
        if buffer: self.register_buffer("scale", torch.ones(2))
    def forward(self, x): return self.fc(x).pow(2).mean()
e = zerompi.initialize(Net(), zerompi.ZeroConfig(stage=3)); e.backward(e(torch.randn(3, 4))); e.step()
e.save_checkpoint("ckpt", tag="t")
f = zerompi.initialize(Net(buffer=False), zerompi.ZeroConfig(stage=3))
f.load_checkpoint("ckpt", "t")       # KeyError: 'scale'; f's parameters are already the checkpoint's
```

**K4 (gap). Nothing binds a tag's files to one save.** Copying `prev/rank00000.h5` (or `prev/index.h5`)
over `good/` loads without an error: the other save's parameters with `good`'s counters and client
state (or the reverse). The README's "Verified" list does not promise this, but a per-save nonce in the
index checked against each rank file's attributes would catch mixed or stale files.

**C1 (wrong exception). An integer beyond the float range in a float-valued key raises
`OverflowError`.** `_float` calls `math.isfinite(value)` on an `int`: `ZeroConfig.from_dict({"lr":
10**400})`, `ZeroConfig(weight_decay=-10**400)`, `from_deepspeed({"gradient_clipping": 10**400})`, and
`from_file` on JSON `{"lr": 1000...0}` (400 digits) or TOML `lr = 1000...0` all raise `OverflowError:
int too large to convert to float` instead of `ConfigError`.

**C2 (error names the wrong key). A DeepSpeed bucket size whose MiB value underflows or overflows is
reported as `bucket_mb`.** `from_deepspeed({"zero_optimization": {"reduce_bucket_size": 1e-320}})` raises
`ConfigError: bucket_mb=0.0 is not a finite number > 0` (1e308: `bucket_mb=inf`); the key the user wrote,
`zero_optimization.reduce_bucket_size`, is not named.

**C3 (wrong exception). A deeply nested JSON or TOML file raises `RecursionError`.** `from_file` on a
`.json` file holding `[` x 100000 + `]` x 100000 (or TOML `x = [[[...]]]`) raises `RecursionError` from
`json.loads` / `tomllib.loads`, which `_load_document` does not catch (it catches `ValueError`).
"""


def _mpi_version() -> str:
    exe = mpiexec()
    text = subprocess.run([exe[0], "--version"], capture_output=True, text=True).stdout
    version = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                    if line.strip().startswith("Version:")), "")
    return f"{Path(exe[0]).name} {version}".strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="kills per world size, and tries per save kill point")
    p.add_argument("--random-kills", type=int, default=25, help="kills at random moments per save mode")
    p.add_argument("--skip-fuzz", action="store_true")
    p.add_argument("--skip-ranks", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results" / "reliability.md")
    args = p.parse_args()
    start = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - start:6.1f} s] {msg}", flush=True)

    import h5py
    import torch
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.node() or "?",
            "cpus": os.cpu_count(), "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "python": platform.python_version(), "torch": torch.__version__, "h5py": h5py.version.version,
            "hdf5": h5py.version.hdf5_version, "mpiexec": _mpi_version(),
            "args": " ".join(sys.argv[1:])}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="zerompi-reliability-") as tmp_name:
        tmp = Path(tmp_name)
        if not args.skip_ranks:
            results["ranks"] = rank_failures(args.repeat, tmp, log)
        if not args.skip_fuzz:
            results["fuzz"] = fuzz(tmp, log)
        # last: it imports zerompi here and forks the saving children from this process
        results["saves"] = interrupted_saves(max(1, args.repeat - 1), args.random_kills, tmp, log)
    meta["seconds"] = time.monotonic() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, meta))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
