"""Interrupted saves: a child forked from a trained single-process engine is SIGKILLed while it saves.

At every step of the save protocol (a wrapper around that function of zerompi/checkpoint/writer.py, or
around pathlib.Path.rename) or at a random moment; then ``latest`` must load with the values of a complete
save, every earlier tag must still load, and the next save must succeed and clean up.
"""
from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import statistics
import time
from pathlib import Path

# The tiny GPT of the checkpoint tests (tests/mpi/workers/common.py's tiny_gpt), defined here: the benchmark
# imports nothing from tests/.
VOCAB, SEQ = 32, 16


def tiny_gpt(seed: int):
    import torch
    from zerompi.models.gpt import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, bias=False))


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
            _, loss = self.engine(data[:, :-1].contiguous(), data[:, 1:].contiguous())
            self.engine.backward(loss)
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
