"""Property-based fuzzing of checkpoint loading: damaged files never load wrong values.

A small real checkpoint is written once per module: a single-process stage-3
engine (world size 1, no mpiexec) trains a tiny model and saves tags ``prev``
and ``good``; one 2-rank stage-3 GPT checkpoint comes from a real ``mpiexec``
job (``tests/mpi/workers/ckpt.py``), so rank files can be swapped and the
single-process loads reshard. Copies of them are damaged by

* 1-8 bit flips anywhere in one file (half of them aimed near HDF5 structures:
  signatures, datatype messages, attribute names, the first data bytes),
* truncation at any offset, deletion of any file, swapped / duplicated rank files,
* loading into a different model or optimizer,
* hostile structures (hostile.py) that are valid HDF5 with valid checksums: soft,
  hard and external links, virtual datasets, external raw storage, filters, a
  2^40-element declaration, datasets swapped between tensors, ranks and saves,
  symbolic links out of the checkpoint; each must be refused by both loaders,
  and a FIFO as the outside target shows that nothing outside is opened,

and then loaded twice: ``load_full_state_dict(root, tag)`` reading every tensor,
and ``engine.load_checkpoint`` into a fresh single-process engine. The
property: a ``CheckpointError`` is raised and the engine is left exactly as it
was, or the load succeeds and every loaded value (parameters, optimizer state,
counters, RNG, buffers, client state, and the error-feedback residuals the
one-process checkpoints hold) is bitwise the original's (the damage hit bytes
HDF5 does not use). Never another exception type, never a crash or hang,
never different values without an error. Randomly damaged copies are loaded in
a long-lived worker process with a per-load time limit, so that a segfault or an
endless loop inside HDF5 is reported instead of taking pytest down.

Bugs this fuzzing found are fixed and kept as regression tests at the end:
K1 (raw h5py errors escaped from damaged HDF5 metadata), K2 (a damaged datatype
loaded other numbers: the CRC now covers the datatype), K3 (a model with other
buffers half-loaded), K4 (a file of another save loaded silently: every file
carries the save's id), K5 (a damaged global-heap object size made HDF5 loop
forever: no attribute lives in the global heap any more), S1 (a kill while
re-saving the tag ``latest`` names).

Set ``ZEROMPI_FUZZ_REPORT=path.json`` to get the counts (section ``checkpoint``; the hostile
structures under ``structure/...`` and ``outside/...``).
"""
from __future__ import annotations

import dataclasses
import faulthandler
import gc
import json
import os
import pathlib
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from tests.components import require_module, unavailable  # noqa: E402

require_module("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import zerompi  # noqa: E402
from zerompi.checkpoint import load_full_state_dict  # noqa: E402
from zerompi.errors import CheckpointError  # noqa: E402
from zerompi.models.gpt import GPT, GPTConfig  # noqa: E402
from tests.unit import hostile  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
HANG_S = 15      # one load of these few-KiB files takes milliseconds; longer is a hang
STARTUP_S = 180  # the load worker imports torch (slow on a busy machine)
FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- models and engines ----------------------------------------------------


class Net(nn.Module):
    """Tiny model with two buckets at bucket_mb=1e-4, and a buffer (stored in index.h5)."""

    def __init__(self, hidden: int = 8, out: int = 3, extra: bool = False, freeze_bias: bool = False,
                 buffer: tuple[int, ...] | None = (3,)):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, hidden), nn.Linear(hidden, out)
        self.mid = nn.Linear(hidden, hidden) if extra else None
        if freeze_bias:
            self.fc1.bias.requires_grad_(False)
        if buffer is not None:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, int(np.prod(buffer))).view(buffer))

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.mid is not None:
            h = torch.tanh(self.mid(h))
        y = self.fc2(h)
        return (y * self.scale if hasattr(self, "scale") else y).pow(2).mean()


# The single-process checkpoints carry error-feedback residuals (b<i>/feedback, per rank) as well.
FEEDBACK = dict(quantize_grads="int8", grad_error_feedback=True)


def one_config(**changes) -> zerompi.ZeroConfig:
    base = dict(stage=3, optimizer="adamw", lr=1e-2, bucket_mb=1e-4, cpu_threads=1, abort_on_exception=False)
    return zerompi.ZeroConfig(**{**base, **changes})


# The model and config of tests/mpi/workers/ckpt.py (tiny_gpt, --stage 3 --optimizer adamw).
GPT_ARGS = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=False)


def gpt_config(**changes) -> zerompi.ZeroConfig:
    base = dict(stage=3, optimizer="adamw", lr=1e-2, weight_decay=0.1, bucket_mb=0.004, cpu_threads=1,
                abort_on_exception=False)
    return zerompi.ZeroConfig(**{**base, **changes})


def make_gpt(**changes) -> GPT:
    torch.manual_seed(5)
    return GPT(GPTConfig(**{**GPT_ARGS, **changes}))


# ---- comparing states bitwise ------------------------------------------------

def _bits(t: torch.Tensor) -> tuple:
    t = t.detach().cpu().contiguous()
    return str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def engine_state(engine, rng: bool = True) -> dict[str, Any]:
    """Everything a load may change: parameters, buffers, optimizer state and options, counters, RNG."""
    out: dict[str, Any] = {f"param/{k}": _bits(v) for k, v in engine.full_state_dict().items()}
    out.update({f"buffer/{k}": _bits(v) for k, v in engine.module.named_buffers()})
    inner = engine.optimizer.inner
    for i, b in enumerate(engine.sharded.buckets):
        for k, v in inner.state.get(b.master, {}).items():
            out[f"state/{i}/{k}"] = _bits(v) if isinstance(v, torch.Tensor) else repr(v)
    for gi, g in enumerate(inner.param_groups):
        for k, v in g.items():
            if k != "params":
                out[f"group/{gi}/{k}"] = repr(v)
    for i, residual in engine.snapshot().residuals:
        out[f"feedback/{i}"] = _bits(residual)
    out["counters"] = (engine.stats.steps, engine.stats.skipped_steps)
    if rng:
        out["rng"] = _bits(torch.get_rng_state())
    return out


def read_full(root: Path, tag: str | None) -> dict[str, tuple]:
    full = load_full_state_dict(root, tag)
    try:
        return {k: _bits(full[k]) for k in full}
    finally:
        full.close()


# ---- bases: pristine checkpoints and what loading them gives ---------------------

@dataclass
class Base:
    name: str
    root: Path                      # holds `good` (and `prev`), latest -> good
    make_engine: Callable[[], Any]
    world: int
    files: list[str] = field(default_factory=list)        # mutable files, relative to root
    sizes: dict[str, int] = field(default_factory=dict)
    hotspots: dict[str, list[int]] = field(default_factory=dict)
    datasets: dict[str, list[str]] = field(default_factory=dict)   # per .h5 file, every dataset
    gcol: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # global heaps (K5)
    ref_full: dict[str, tuple] = field(default_factory=dict)
    ref_engine: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"Base({self.name!r}, {str(self.root)!r})"

    @property
    def rng(self) -> bool:  # the RNG state is restored only at the same world size
        return self.world == 1


_SIGNATURES = (b"\x89HDF", b"OHDR", b"OCHK", b"HEAP", b"TREE", b"SNOD", b"GCOL", b"FRHP", b"BTHD", b"BTLF")
_NAMES = (b"crc32", b"format", b"kind", b"version", b"rank", b"world_size", b"torch_dtype", b"shape")
_DTYPES = (b"\x11\x20\x1f\x00\x04\x00\x00\x00",   # IEEE float32 little-endian datatype message
           b"\x10\x00\x00\x00\x01\x00\x00\x00",   # uint8
           b"\x10\x08\x00\x00\x08\x00\x00\x00",   # int64
           b"\x10\x00\x00\x00\x04\x00\x00\x00")   # uint32 (the crc32 attribute)


def hotspots(path: Path) -> list[int]:
    """Offsets of HDF5 structures: signatures, attribute names, datatype messages, first data bytes."""
    raw = path.read_bytes()
    spots = {m.start() for pat in (*_SIGNATURES, *_NAMES, *_DTYPES) for m in re.finditer(re.escape(pat), raw)}
    with h5py.File(path, "r") as f:
        def visit(_name, obj):
            if isinstance(obj, h5py.Dataset) and obj.id.get_offset() is not None:
                spots.add(obj.id.get_offset())
        f.visititems(visit)
    return sorted(spots)


def dataset_names(path: Path) -> list[str]:
    out: list[str] = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.append(n) if isinstance(o, h5py.Dataset) else None)
    return out


def prepare_base(name: str, root: Path) -> Base:
    if name == "one":
        base = Base(name, root, lambda: zerompi.initialize(Net(), one_config(**FEEDBACK)), world=1)
    elif name == "frozen":  # stage 3 with a frozen bucket (f0/param), and an adapters-only tag
        base = Base(name, root, lambda: zerompi.initialize(Net(freeze_bias=True), one_config(dtype="bf16")),
                    world=1)
    else:
        base = Base(name, root, lambda: zerompi.initialize(make_gpt(), gpt_config()), world=2)
    base.files = ["latest"] + sorted(f"good/{p.name}" for p in (root / "good").iterdir())
    base.sizes = {f: (root / f).stat().st_size for f in base.files}
    base.hotspots = {f: hotspots(root / f) for f in base.files if f.endswith(".h5")}
    base.hotspots["latest"] = [0]
    base.gcol = {f: global_heaps(root / f) for f in base.files if f.endswith(".h5")}
    base.datasets = {f: dataset_names(root / f) for f in base.files if f.endswith(".h5")}
    base.ref_full = read_full(root, "good")
    engine = base.make_engine()
    client = engine.load_checkpoint(root, "good")
    base.ref_engine = engine_state(engine, base.rng) | {"client_state": json.dumps(client, sort_keys=True)}
    engine.close()
    return base


def write_one(root: Path, frozen: bool = False) -> None:
    """Single-process stage-3 engine: train 2 steps, save `prev`, train 1, save `good` (latest).
    ``frozen``: fc1's bias frozen, bf16 (its shard stored as raw bf16 bits), and `prev` without it;
    else with quantized gradients and error feedback (the residuals are saved too)."""
    engine = zerompi.initialize(Net(freeze_bias=frozen), one_config(**(dict(dtype="bf16") if frozen else FEEDBACK)))
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        engine.backward(engine(torch.randn(6, 4, generator=g)))
        engine.step()
        if step == 1:
            engine.save_checkpoint(root, tag="prev", client_state={"next_step": 2}, include_frozen=not frozen)
    engine.save_checkpoint(root, tag="good", client_state={"next_step": 3, "note": "good"})
    engine.close()


def write_two(root: Path) -> str:
    """A 2-rank stage-3 GPT checkpoint from a real MPI job: '', or why no MPI launcher could write it."""
    from tests.mpi.launcher import run_mpi
    try:
        run_mpi(2, "ckpt.py", "--mode", "save", "--root", str(root), "--out", str(root.parent / "two.npz"),
                "--before", "2", "--after", "0", "--tag", "good", timeout=300)
    except (RuntimeError, OSError) as e:  # no mpiexec on this machine
        return f"no 2-rank checkpoint: {e}"
    return ""


# ---- mutations ---------------------------------------------------------------------

@dataclass(frozen=True)
class Mutation:
    base: str
    kind: str                                  # flip | truncate | delete | swap | copy, or one of STRUCTURAL
    path: str                                  # relative to the root
    flips: tuple[tuple[int, int], ...] = ()    # (byte offset, bit)
    size: int = 0                              # truncate: new length
    other: str = ""                            # swap / copy: the second file; structural: see STRUCTURAL
    dataset: str = ""                          # structural: the dataset changed in ``path``
    fifo: bool = False                         # structural: the target outside the root is a FIFO

    @property
    def tag(self) -> str | None:
        return None if self.path == "latest" else "good"

    def apply(self, root: Path) -> None:
        target = root / self.path
        if self.kind == "flip":
            raw = bytearray(target.read_bytes())
            for pos, bit in self.flips:
                raw[pos] ^= 1 << bit
            target.write_bytes(bytes(raw))
        elif self.kind == "truncate":
            with open(target, "r+b") as fh:
                fh.truncate(self.size)
        elif self.kind == "delete":
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        elif self.kind == "swap":
            tmp = target.with_name("swap.tmp")
            target.rename(tmp)
            (root / self.other).rename(target)
            tmp.rename(root / self.other)
        elif self.kind == "copy":  # `other` replaces `path`
            shutil.copyfile(root / self.other, target)
        elif self.kind in STRUCTURAL:
            STRUCTURAL[self.kind](self, root)
        else:
            raise ValueError(self.kind)

    def __str__(self) -> str:
        extra = {"flip": f" flips(offset, bit)={list(self.flips)}", "truncate": f" to {self.size} bytes",
                 "swap": f" <-> {self.other}", "copy": f" := {self.other}"}.get(self.kind, "")
        if self.kind in STRUCTURAL:
            extra = f" {self.dataset}{' / ' + self.other if self.other else ''}{' (FIFO)' if self.fifo else ''}"
        return f"[{self.base}] {self.kind} {self.path}{extra}"


def _swap_saves(m: Mutation, root: Path) -> None:
    """``m.other`` is the same rank file of another save (outside this copy): a copy of it is used."""
    other = hostile.outside(root) / f"other-save-{Path(m.path).name}"
    shutil.copyfile(m.other, other)
    hostile.swap_files(root, m.path, other, m.dataset)


# Structural mutations (hostile.py): each must be refused by both loaders, reading nothing outside.
STRUCTURAL: dict[str, Callable[[Mutation, Path], None]] = {
    "soft_link": lambda m, root: hostile.soft_link(root, m.path, m.dataset, m.other),
    "hard_link": lambda m, root: hostile.hard_link(root, m.path, m.dataset, m.other),
    "external_link": lambda m, root: hostile.external_link(root, m.path, m.dataset, m.fifo),
    "virtual": lambda m, root: hostile.virtual(root, m.path, m.dataset, m.fifo),
    "external_storage": lambda m, root: hostile.external_storage(root, m.path, m.dataset, m.fifo),
    "filter": lambda m, root: hostile.filtered(root, m.path, m.dataset, m.other),
    "huge": lambda m, root: hostile.huge(root, m.path, m.dataset),
    "swap_tensors": lambda m, root: hostile.swap_tensors(root, m.path, m.dataset, m.other),
    "swap_ranks": lambda m, root: hostile.swap_files(root, m.path, root / m.other, m.dataset),
    "swap_saves": _swap_saves,
    "symlink_out": lambda m, root: hostile.symlink_out(root, m.path),
}


class HypothesisDraw:
    def __init__(self, data):
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, seq):
        return self.data.draw(st.sampled_from(list(seq)))


def draw_flip(d, base: Base) -> Mutation:
    path = d.choice([f for f in base.files if f.endswith(".h5")] + ["latest"])
    size, spots = base.sizes[path], base.hotspots[path]
    flips = []
    for _ in range(d.int(1, 8)):
        if d.choice(("near a structure", "anywhere")) == "anywhere":
            pos = d.int(0, size - 1)
        else:
            pos = min(size - 1, max(0, d.choice(spots) + d.int(-16, 48)))
        flips.append((pos, d.int(0, 7)))
    return Mutation(base.name, "flip", path, flips=tuple(flips))


def draw_truncate(d, base: Base) -> Mutation:
    path = d.choice(base.files)
    return Mutation(base.name, "truncate", path, size=d.int(0, base.sizes[path] - 1))


# ---- loading one damaged copy -----------------------------------------------------------

@dataclass
class Result:
    outcome: str           # detected | identical | different | half | other | hang | crash
    error: str = ""
    in_h5py: bool = False  # an "other" exception raised from inside h5py (K1)


def _raised_in_h5py(e: BaseException) -> bool:
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and "h5py" in Path(frames[-1].filename).parts


def _message(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def load_with_full(base: Base, root: Path, tag: str | None) -> Result:
    try:
        got = read_full(root, tag)
    except CheckpointError as e:
        return Result("detected", _message(e))
    except Exception as e:  # noqa: BLE001 - any other type is what the property forbids
        return Result("other", _message(e), _raised_in_h5py(e))
    return Result("identical" if got == base.ref_full else "different")


def load_with_engine(base: Base, root: Path, tag: str | None) -> Result:
    engine = base.make_engine()
    try:
        before = engine_state(engine)
        try:
            client = engine.load_checkpoint(root, tag)
        except CheckpointError as e:
            return Result("detected" if engine_state(engine) == before else "half", _message(e))
        except Exception as e:  # noqa: BLE001
            kept = engine_state(engine) == before
            return Result("other" if kept else "half", _message(e), _raised_in_h5py(e))
        got = engine_state(engine, base.rng) | {"client_state": json.dumps(client, sort_keys=True)}
        return Result("identical" if got == base.ref_engine else "different")
    finally:
        engine.close()


def _dtypes(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with h5py.File(path, "r") as f:
            f.visititems(lambda n, o: out.__setitem__(n, o.dtype.str) if isinstance(o, h5py.Dataset) else None)
    except Exception:  # noqa: BLE001 - unreadable: no dtype evidence
        return {}
    return out


def dtype_changed(base: Base, m: Mutation, root: Path) -> bool:
    """Whether the damage changed the stored datatype of some dataset (the K2 signature)."""
    if m.kind != "flip" or not m.path.endswith(".h5"):
        return False
    before, after = _dtypes(base.root / m.path), _dtypes(root / m.path)
    return any(k in after and after[k] != v for k, v in before.items())


def examine(base: Base, m: Mutation, root: Path) -> dict[str, Any]:
    """Both loads of the damaged copy at ``root``, as JSON."""
    full = load_with_full(base, root, m.tag)
    eng = load_with_engine(base, root, m.tag)
    return {"full": dataclasses.astuple(full), "engine": dataclasses.astuple(eng),
            "k2": dtype_changed(base, m, root)}


def global_heaps(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of the HDF5 global heap collections (variable-length strings) of a pristine file."""
    raw = path.read_bytes()
    out = []
    for hit in re.finditer(b"GCOL", raw):
        size = int.from_bytes(raw[hit.start() + 8:hit.start() + 16], "little")
        out.append((hit.start(), hit.start() + size))
    return out


# ---- the load worker: every damaged copy is loaded out of process ------------------------
# A segfault or an endless loop inside HDF5 must not take pytest down with it: a
# long-lived worker process loads each copy; a request that takes longer than
# HANG_S is a hang, the worker is killed and a fresh one started.

WORKER = r"""
import faulthandler, sys
faulthandler.enable()
sys.path.insert(0, {root!r})
from tests.unit.checkpoint.test_fuzz_checkpoint import serve
serve()
"""


def serve() -> None:
    """Worker loop: first line {name: root}; then one mutation per line, one JSON answer each."""
    bases = {k: prepare_base(k, Path(v)) for k, v in json.loads(sys.stdin.readline()).items()}
    print("@@" + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        m = Mutation(**{**req["mutation"], "flips": tuple(map(tuple, req["mutation"]["flips"]))})
        print("@@" + json.dumps(examine(bases[m.base], m, Path(req["root"]))), flush=True)


class LoadWorker:
    def __init__(self, bases: dict[str, Base], log: Path):
        self.bases, self.log = bases, log
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()
        self.starts = 0

    def _start(self) -> None:
        from tests.mpi.launcher import mpi_env
        self.lines = queue.Queue()
        with open(self.log, "a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER.format(root=str(ROOT))], cwd=ROOT,
                                         env=mpi_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        threading.Thread(target=self._pump, args=(self.proc, self.lines), daemon=True).start()
        self.proc.stdin.write(json.dumps({k: str(b.root) for k, b in self.bases.items()}) + "\n")
        self.proc.stdin.flush()
        ready = self._answer(STARTUP_S)
        assert ready == {"ready": True}, f"the load worker did not start: {ready}; see {self.log}"

    @staticmethod
    def _pump(proc, lines) -> None:
        for line in proc.stdout:
            if line.startswith("@@"):
                lines.put(json.loads(line[2:]))
        lines.put(None)

    def _answer(self, timeout: float) -> dict:
        try:
            got = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            return {"hang": True}
        if got is None:
            rc = self.proc.wait()
            self.proc = None
            return {"crash": rc}
        return got

    def examine(self, m: Mutation, root: Path, timeout: float = HANG_S) -> dict:
        if self.proc is None:
            self.starts += 1
            self._start()
        self.proc.stdin.write(json.dumps({"mutation": dataclasses.asdict(m), "root": str(root)}) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdin.close()
            self.proc = None


# ---- judging ---------------------------------------------------------------------------------

def in_global_heap(base: Base, m: Mutation) -> bool:
    return m.kind == "flip" and any(lo <= pos < hi for pos, _ in m.flips for lo, hi in base.gcol.get(m.path, []))


def verdict(r: Result, k2: bool) -> str:
    """ok or VIOLATION (``k2`` is kept for the report's columns)."""
    return "ok" if r.outcome in ("detected", "identical") else "VIOLATION"


class Tally:
    """Counts for the report: per mutation kind, per loader outcome, and overall."""

    def __init__(self):
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.errors: Counter = Counter()
        self.examples: dict[str, str] = {}

    def add(self, section: str, m: Mutation, full: Result, eng: Result, verdicts: tuple[str, str]) -> None:
        c = self.counts[f"{section}/{m.base}/{m.kind}"]
        c["tried"] += 1
        c[f"full_{full.outcome}"] += 1
        c[f"engine_{eng.outcome}"] += 1
        known = sorted({v for v in verdicts if v.startswith("K")})
        if "VIOLATION" in verdicts:
            overall = "violation"
        elif known:
            overall = "known_bug_" + "+".join(known)
        elif "detected" in (full.outcome, eng.outcome):
            overall = "detected"
        else:
            overall = "unused_bytes"
        c[overall] += 1
        for r in (full, eng):
            if r.outcome in ("other", "half", "different", "hang", "crash"):
                key = f"{r.outcome}: {r.error.split(' (', 1)[0][:100]}"
                self.errors[key] += 1
                self.examples.setdefault(key, str(m))

    def summary(self) -> dict[str, Any]:
        total = Counter()
        for k, c in self.counts.items():
            if not k.startswith("worker"):
                total.update(c)
        return {"total": dict(total), "by_kind": {k: dict(v) for k, v in sorted(self.counts.items())},
                "non_checkpoint_outcomes": dict(self.errors.most_common()), "first_example": self.examples}


TALLY = Tally()
_seq = [0]


def fresh_copy(base: Base, workdir: Path) -> Path:
    """A copy of ``good`` and ``latest``; it stays until the module ends, so a new file never reuses
    the inode of one HDF5 may still hold open."""
    _seq[0] += 1
    root = workdir / f"m{_seq[0]:05d}"
    shutil.copytree(base.root, root, ignore=shutil.ignore_patterns("prev", "*.npz"))
    return root


def run_mutation(base: Base, m: Mutation, workdir: Path, worker: LoadWorker | None = None,
                 timeout: float = HANG_S, record: str | None = None) -> tuple[Result, Result, tuple[str, str]]:
    """Apply ``m`` to a fresh copy and load it (in ``worker`` if given, else in this process);
    ``record`` names the report section that counts it."""
    root = fresh_copy(base, workdir)
    m.apply(root)
    if worker is None:
        faulthandler.dump_traceback_later(HANG_S * 4, exit=True)
        try:
            answer = examine(base, m, root)
        finally:
            faulthandler.cancel_dump_traceback_later()
    else:
        answer = worker.examine(m, root, timeout)
    if "hang" in answer or "crash" in answer:
        what = "hang" if "hang" in answer else "crash"
        detail = f"no answer within {timeout} s" if what == "hang" else f"worker exit status {answer['crash']}"
        full = eng = Result(what, detail)
        known = "VIOLATION"
        verdicts = (known, known)
    else:
        full, eng = Result(*answer["full"]), Result(*answer["engine"])
        verdicts = (verdict(full, answer["k2"]), verdict(eng, answer["k2"]))
    if record:
        TALLY.add(record, m, full, eng, verdicts)
    return full, eng, verdicts


def check(base: Base, m: Mutation, workdir: Path, worker: LoadWorker) -> None:
    full, eng, verdicts = run_mutation(base, m, workdir, worker, record="fuzz")
    assert "VIOLATION" not in verdicts, (
        f"{m}\n  load_full_state_dict: {full.outcome} {full.error}\n  engine.load_checkpoint: {eng.outcome} "
        f"{eng.error}\n(reproduce: apply this mutation to a copy of the checkpoint and load it)")


# ---- fixtures ---------------------------------------------------------------------------

def _write_report(section: str, summary: dict) -> None:
    path = os.environ.get("ZEROMPI_FUZZ_REPORT")
    if not path:
        return
    p = Path(path)
    doc = json.loads(p.read_text()) if p.exists() and p.stat().st_size else {}
    doc[section] = summary
    p.write_text(json.dumps(doc, indent=1, sort_keys=True))


NOT_WRITTEN: dict[str, str] = {}  # base -> why the bases fixture could not write it


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    top = tmp_path_factory.mktemp("fuzzckpt")
    write_one(top / "one")
    write_one(top / "frozen", frozen=True)
    out = {"one": prepare_base("one", top / "one"), "frozen": prepare_base("frozen", top / "frozen")}
    NOT_WRITTEN["two"] = write_two(top / "two")
    if not NOT_WRITTEN["two"]:
        out["two"] = prepare_base("two", top / "two")
    yield out
    extra = TALLY.summary()
    extra["bases"] = {k: {"world_size": b.world, "file_bytes": b.sizes} for k, b in out.items()}
    _write_report("checkpoint", extra)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mutated")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def worker(bases, tmp_path_factory):
    w = LoadWorker(bases, tmp_path_factory.mktemp("worker") / "stderr.log")
    yield w
    w.stop()
    TALLY.counts["worker"]["restarts"] = max(0, w.starts - 1)


def _handles_open() -> int:
    return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)


# ---- the pristine checkpoints ---------------------------------------------------------------

def test_pristine_checkpoints_load_identically(bases):
    """Sanity of the references: both loaders agree with each other on every base."""
    assert "one" in bases
    for base in bases.values():
        for name, bits in base.ref_full.items():
            assert base.ref_engine[f"param/{name}"] == bits
        assert base.ref_engine["counters"][0] == (2 if base.name == "two" else 3)


# ---- fuzz: bit flips, truncations -------------------------------------------------------

@settings(max_examples=120, **FUZZ)
@given(data=st.data())
def test_fuzz_bit_flips(bases, workdir, worker, data):
    d = HypothesisDraw(data)
    base = bases[d.choice(sorted(bases))]
    check(base, draw_flip(d, base), workdir, worker)


@settings(max_examples=30, **FUZZ)
@given(data=st.data())
def test_fuzz_truncations(bases, workdir, worker, data):
    d = HypothesisDraw(data)
    base = bases[d.choice(sorted(bases))]
    check(base, draw_truncate(d, base), workdir, worker)


# ---- deleted, swapped and duplicated files (few enough to try them all) --------------

FILE_CASES = [
    ("one", "delete", "latest", ""), ("one", "delete", "good/index.h5", ""),
    ("one", "delete", "good/rank00000.h5", ""), ("one", "delete", "good", ""),
    ("one", "swap", "good/index.h5", "good/rank00000.h5"),
    ("one", "copy", "good/index.h5", "good/rank00000.h5"), ("one", "copy", "good/rank00000.h5", "good/index.h5"),
    ("two", "delete", "latest", ""), ("two", "delete", "good/index.h5", ""),
    ("two", "delete", "good/rank00000.h5", ""), ("two", "delete", "good/rank00001.h5", ""),
    ("two", "swap", "good/rank00000.h5", "good/rank00001.h5"),
    ("two", "copy", "good/rank00001.h5", "good/rank00000.h5"),
    ("two", "copy", "good/rank00000.h5", "good/rank00001.h5"),
    ("two", "swap", "good/index.h5", "good/rank00001.h5"),
]


@pytest.mark.parametrize("base_name,kind,path,other", FILE_CASES,
                         ids=[f"{b}-{k}-{p.split('/')[-1]}{'-' + o.split('/')[-1] if o else ''}"
                              for b, k, p, o in FILE_CASES])
def test_deleted_swapped_and_copied_files_are_detected(bases, workdir, base_name, kind, path, other):
    if base_name not in bases:
        unavailable("mpiexec", NOT_WRITTEN.get(base_name, "no 2-rank checkpoint"))
    m = Mutation(base_name, kind, path, other=other)
    full, eng, verdicts = run_mutation(bases[base_name], m, workdir, record="files")
    assert verdicts == ("ok", "ok"), (str(m), full, eng)
    # every one of these must be refused, naming the file that is wrong
    assert (full.outcome, eng.outcome) == ("detected", "detected"), (str(m), full, eng)
    name = Path(path if kind != "copy" else path).name
    assert name in full.error or (path == "good" and "good" in full.error), full.error


# ---- hostile structure: links, virtual datasets, external storage, filters, swapped data -----------
# Hand-crafted files (hostile.py) that are valid HDF5 with valid checksums: before they were
# refused, an external-storage or swapped dataset loaded without an error. Every one must be
# refused by both loaders with a CheckpointError naming the file, the object and the reason.

R0, R1, IDX = "good/rank00000.h5", "good/rank00001.h5", "good/index.h5"
STRUCTURE_CASES = [  # (base, kind, path, dataset, other, what the error says)
    ("one", "soft_link", R0, "b0/master", "b0/state/exp_avg", "soft link"),
    ("one", "external_link", R0, "b0/master", "", "external link"),
    ("one", "virtual", R0, "b0/master", "", "virtual dataset"),
    ("one", "external_storage", R0, "b0/master", "", "external files"),
    ("one", "external_storage", IDX, "replicated/scale", "", "external files"),
    ("one", "external_link", IDX, "meta", "", "external link"),
    ("one", "filter", R0, "b0/master", "fletcher32", "filter"),
    ("one", "filter", R0, "b1/master", "gzip", "filter"),
    ("one", "filter", R0, "rng/torch_cpu", "lzf", "filter"),
    ("one", "filter", IDX, "replicated/scale", "shuffle", "filter"),
    ("one", "huge", R0, "b0/master", "", "more than the whole file"),
    ("one", "hard_link", R0, "b0/master", "b0/state/exp_avg", "checksum mismatch"),
    ("one", "swap_tensors", R0, "b0/master", "b0/state/exp_avg", "checksum mismatch"),
    ("one", "swap_tensors", R0, "b0/master", "b1/master", "shape"),
    ("one", "swap_saves", R0, "b0/master", "prev/rank00000.h5", "checksum mismatch"),
    ("one", "swap_tensors", R0, "b0/master", "b0/feedback", "checksum mismatch"),
    ("one", "filter", R0, "b1/feedback", "gzip", "filter"),
    ("one", "soft_link", R0, "b0/feedback", "b0/master", "soft link"),
    ("one", "symlink_out", "good", "", "", "outside the checkpoint root"),
    ("one", "symlink_out", "latest", "", "", "outside the checkpoint root"),
    ("one", "symlink_out", R0, "", "", "outside the checkpoint directory"),
    ("one", "symlink_out", IDX, "", "", "outside the checkpoint directory"),
    ("frozen", "swap_tensors", R0, "f0/param", "b0/master", "shape"),
    ("frozen", "hard_link", R0, "f0/param", "b0/state/exp_avg", "shape"),
    ("frozen", "filter", R0, "f0/param", "gzip", "filter"),
    ("frozen", "external_storage", R0, "f0/param", "", "external files"),
    ("frozen", "swap_saves", R0, "b0/master", "prev/rank00000.h5", "checksum mismatch"),
    ("two", "swap_ranks", R0, "b0/master", R1, "checksum mismatch"),
    ("two", "swap_ranks", R0, "b1/master", R1, "checksum mismatch"),
    ("two", "soft_link", R1, "b0/master", "b0/state/exp_avg", "soft link"),
    ("two", "external_storage", R1, "b1/master", "", "external files"),
    ("two", "symlink_out", "good", "", "", "outside the checkpoint root"),
]


def _structure_id(case) -> str:
    base, kind, path, dataset, other, _ = case
    return "-".join(x.split("/")[-1] for x in (base, kind, path, dataset, other) if x)


def _mutation(base: Base, kind: str, path: str, dataset: str = "", other: str = "", fifo: bool = False) -> Mutation:
    if kind == "swap_saves":  # the rank file of the save before, from the pristine base
        other = str(base.root / other)
    return Mutation(base.name, kind, path, other=other, dataset=dataset, fifo=fifo)


@pytest.mark.parametrize("case", STRUCTURE_CASES, ids=[_structure_id(c) for c in STRUCTURE_CASES])
def test_hostile_structures_are_refused(bases, workdir, worker, case):
    base_name, kind, path, dataset, other, says = case
    if base_name not in bases:
        unavailable("mpiexec", NOT_WRITTEN.get(base_name, "no 2-rank checkpoint"))
    m = _mutation(bases[base_name], kind, path, dataset, other)
    full, eng, _ = run_mutation(bases[base_name], m, workdir, worker, record="structure")
    assert (full.outcome, eng.outcome) == ("detected", "detected"), (str(m), full, eng)
    for r in (full, eng):
        assert says in r.error, (str(m), r.error)
        named = Path(path).name if kind != "symlink_out" else path
        assert named in r.error and (not dataset or kind.startswith(("swap", "hard")) or dataset in r.error), \
            (str(m), r.error)


PER_DATASET = ("soft_link", "external_link", "virtual", "external_storage", "filter", "huge")


@settings(max_examples=40, **FUZZ)
@given(data=st.data())
def test_fuzz_hostile_structure_anywhere(bases, workdir, worker, data):
    """Any of these structures on any dataset of any file is refused: a file is checked whole on opening."""
    d = HypothesisDraw(data)
    base = bases[d.choice(sorted(bases))]
    path = d.choice(sorted(base.datasets))
    dataset = d.choice(base.datasets[path])
    kind = d.choice(PER_DATASET)
    other = {"soft_link": d.choice(base.datasets[path]), "filter": d.choice(sorted(hostile.FILTERS))}.get(kind, "")
    m = _mutation(base, kind, path, dataset, other)
    full, eng, _ = run_mutation(base, m, workdir, worker, record="structure")
    assert (full.outcome, eng.outcome) == ("detected", "detected"), (str(m), full, eng)


@pytest.mark.parametrize("kind", ["external_storage", "virtual", "external_link"])
def test_nothing_outside_the_checkpoint_is_opened(bases, workdir, worker, kind):
    """The target outside the checkpoint is a FIFO: opening it would block, so a loader that touched
    it would hang (the worker's time limit turns that into a failure) instead of failing fast."""
    base = bases["one"]
    m = _mutation(base, kind, R0, "b0/master", fifo=True)
    full, eng, _ = run_mutation(base, m, workdir, worker, timeout=10, record="outside")
    assert (full.outcome, eng.outcome) == ("detected", "detected"), (str(m), full, eng)


def test_no_hdf5_file_stays_open_after_failed_loads(bases, workdir):
    """A refused load closes what it opened (a leaked handle could alias a later file's inode)."""
    gc.collect()
    start = _handles_open()
    heap = (bases["one"].root / "good" / "rank00000.h5").read_bytes().index(b"HEAP")
    for m in (Mutation("one", "copy", "good/rank00000.h5", other="good/index.h5"),
              Mutation("one", "flip", "good/rank00000.h5", flips=((heap, 0),))):  # K1: a raw RuntimeError
        run_mutation(bases["one"], m, workdir)
    gc.collect()
    assert _handles_open() == start


# ---- a different model or optimizer ------------------------------------------------------

ONE_VARIANTS = [  # (model kwargs, config changes, loads?)
    (dict(hidden=6), {}, False), (dict(hidden=9), {}, False), (dict(out=2), {}, False),
    (dict(extra=True), {}, False), (dict(freeze_bias=True), {}, False),
    ({}, dict(optimizer="sgd", momentum=0.9), False), ({}, dict(optimizer="adam"), False),
    ({}, dict(stage=0), True), ({}, dict(stage=1), True), ({}, dict(stage=2), True),
    ({}, dict(bucket_mb=25.0), True), ({}, dict(stage=1, bucket_mb=3e-5), True),
    ({}, dict(dtype="bf16"), True),
]
FROZEN_VARIANTS = [  # the bf16 checkpoint with fc1's bias frozen (and sharded)
    ({}, dict(dtype="bf16"), True), ({}, dict(dtype="bf16", stage=1), True), ({}, dict(stage=3), True),
    (dict(freeze_bias=False), dict(dtype="bf16"), False), (dict(hidden=9, freeze_bias=True), dict(dtype="bf16"), False),
]
TWO_VARIANTS = [
    (dict(n_embd=24), {}, False), (dict(n_layer=1), {}, False), (dict(n_layer=3), {}, False),
    (dict(vocab_size=33), {}, False), (dict(bias=True), {}, False), (dict(block_size=32), {}, False),
    ({}, dict(optimizer="sgd"), False),  # an adamw checkpoint into sgd: refused (optimizer state)
    ({}, dict(stage=0), True), ({}, dict(stage=2, bucket_mb=25.0), True),
]


@settings(max_examples=25, **FUZZ)
@given(data=st.data())
def test_fuzz_other_model_or_layout(bases, data):
    """A different model or optimizer is refused with the engine untouched; another stage, bucket size
    or compute dtype loads the same fp32 values."""
    d = HypothesisDraw(data)
    base = bases[d.choice(sorted(bases))]
    variants = {"one": ONE_VARIANTS, "frozen": FROZEN_VARIANTS, "two": TWO_VARIANTS}[base.name]
    model_kw, cfg_kw, loads = d.choice(variants)
    if base.name == "one":
        engine = zerompi.initialize(Net(**model_kw), one_config(**cfg_kw))
    elif base.name == "frozen":
        engine = zerompi.initialize(Net(**{"freeze_bias": True, **model_kw}), one_config(**cfg_kw))
    else:
        engine = zerompi.initialize(make_gpt(**model_kw), gpt_config(**cfg_kw))
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        before = engine_state(engine)
        try:
            engine.load_checkpoint(base.root, "good")
            error = None
        except CheckpointError as e:
            error = str(e)
        if loads:
            assert error is None, (model_kw, cfg_kw, error)
            got = {k.removeprefix("param/"): v for k, v in engine_state(engine).items() if k.startswith("param/")}
            assert got == base.ref_full, (model_kw, cfg_kw)
        else:
            assert error is not None, (model_kw, cfg_kw)
            assert "different model" in error or "optimizer state" in error, error
            assert engine_state(engine) == before, "a refused load changed the engine"
    finally:
        faulthandler.cancel_dump_traceback_later()
        engine.close()


# ---- regressions of bugs the fuzzing found -----------------------------------------------------------

def _fresh_copy(base: Base, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(base.root, root)
    return root


def _flip(path: Path, pos: int, bit: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 1 << bit
    path.write_bytes(bytes(raw))


def _datatype_flip(path: Path, dataset: str, pattern: bytes, byte: int, bit: int, want: str) -> None:
    """Flip one bit of the datatype message of ``dataset`` (found by trying each occurrence)."""
    original = path.read_bytes()
    for m in re.finditer(re.escape(pattern), original):
        _flip(path, m.start() + byte, bit)
        try:
            with h5py.File(path, "r") as f:
                if f[dataset].dtype.str == want:
                    return
        except Exception:  # noqa: BLE001 - that occurrence was another structure
            pass
        path.write_bytes(original)
    raise LookupError(f"no datatype message of {dataset} found")


@pytest.mark.parametrize("loader", ["load_full_state_dict", "engine.load_checkpoint"])
def test_k1_damaged_local_heap_is_a_checkpoint_error(bases, tmp_path, loader):
    root = _fresh_copy(bases["one"], tmp_path)
    rank = root / "good" / "rank00000.h5"
    _flip(rank, rank.read_bytes().index(b"HEAP"), 0)  # the root group's local heap signature
    with pytest.raises(CheckpointError):  # today: RuntimeError: Unable to synchronously check link existence
        read_full(root, "good") if loader == "load_full_state_dict" else \
            bases["one"].make_engine().load_checkpoint(root, "good")


def test_k1_k5_no_checkpoint_file_has_a_global_heap(bases):
    """Variable-length strings live in HDF5's global heap, where a damaged object size made HDF5
    loop forever (K5) or fail inside h5py (K1); zerompi writes none, so no file has one."""
    for base in bases.values():
        for path in pathlib.Path(base.root).rglob("*.h5"):
            assert b"GCOL" not in path.read_bytes(), path


@pytest.mark.parametrize("loader", ["load_full_state_dict", "engine.load_checkpoint"])
def test_k2_byte_order_flip_is_detected(bases, tmp_path, loader):
    base = bases["one"]
    root = _fresh_copy(base, tmp_path)
    _datatype_flip(root / "good" / "rank00000.h5", "b0/master", _DTYPES[0], 1, 0, ">f4")
    if loader == "load_full_state_dict":
        try:
            got = read_full(root, "good")
        except CheckpointError:
            return
        assert got == base.ref_full, "different values without an error"  # today: e.g. 2.8e35 for -0.35
    else:
        engine = base.make_engine()
        before = engine_state(engine)
        try:
            client = engine.load_checkpoint(root, "good")
        except CheckpointError:
            assert engine_state(engine) == before
            return
        got = engine_state(engine, base.rng) | {"client_state": json.dumps(client, sort_keys=True)}
        assert got == base.ref_engine, "different values without an error"


def test_k2_rng_signedness_flip_is_detected_before_loading(bases, tmp_path):
    base = bases["one"]
    root = _fresh_copy(base, tmp_path)
    _datatype_flip(root / "good" / "rank00000.h5", "rng/torch_cpu", _DTYPES[1], 1, 3, "|i1")
    engine = base.make_engine()
    before = engine_state(engine)
    with pytest.raises(CheckpointError):
        engine.load_checkpoint(root, "good")  # today: TypeError: RNG state must be a torch.ByteTensor
    assert engine_state(engine) == before


@pytest.mark.parametrize("buffer", [None, (4,)], ids=["missing-buffer", "buffer-of-other-size"])
def test_k3_model_with_other_buffers_is_refused_untouched(bases, buffer):
    engine = zerompi.initialize(Net(buffer=buffer), one_config())
    before = engine_state(engine)
    try:
        engine.load_checkpoint(bases["one"].root, "good")
        error = "no error"
    except Exception as e:  # noqa: BLE001 - today: KeyError 'scale' / RuntimeError: shape '[4]' is invalid
        error = f"{type(e).__name__}: {e}"
    assert error.startswith("CheckpointError") and "different model" in error, error
    assert engine_state(engine) == before, "parameters were overwritten by a refused load"


@pytest.mark.parametrize("stale", ["rank00000.h5", "index.h5"])
def test_k4_file_of_another_save_is_refused(bases, tmp_path, stale):
    base = bases["one"]
    root = _fresh_copy(base, tmp_path)
    shutil.copyfile(root / "prev" / stale, root / "good" / stale)
    engine = base.make_engine()
    try:
        client = engine.load_checkpoint(root, "good")
    except CheckpointError:
        return
    got = engine_state(engine, base.rng) | {"client_state": json.dumps(client, sort_keys=True)}
    assert got == base.ref_engine, "a mix of two saves loaded without an error"


def test_k5_fuzzed_flips_near_attributes_never_hang(bases, workdir, worker):
    """Flips in the attribute area of index.h5 (where K5's heap used to be) end in an error or
    identical values within the per-load time limit."""
    base, path = bases["one"], "good/index.h5"
    raw = (pathlib.Path(base.root) / path).read_bytes()
    at = raw.index(b"format")
    for byte in range(at - 16, at + 24, 4):
        m = Mutation("one", "flip", path, flips=((byte, 7),))
        full, eng, _ = run_mutation(base, m, workdir, worker, timeout=10)
        assert full.outcome in ("detected", "identical") and eng.outcome in ("detected", "identical"), \
            (byte, full, eng)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_killed_resave_of_latest_tag_keeps_it_loadable(tmp_path):
    """S1 (fixed in 55d347e): re-save the tag `latest` names; SIGKILL right after `_publish` moved the
    old directory aside (the first Path.rename of the save). Before the fix `latest` named a missing
    directory and the next save deleted both copies. benchmarks/reliability.py tries every point."""
    root = tmp_path / "ckpt"
    engine = zerompi.initialize(Net(), one_config())
    for tag in ("last", None):
        engine.backward(engine(torch.randn(6, 4)))
        engine.step()
        if tag:
            engine.save_checkpoint(root, tag=tag)
    old, new = read_full(root, "last"), {k: _bits(v) for k, v in engine.full_state_dict().items()}
    pid = os.fork()
    if pid == 0:  # the child saves and is killed; it never returns into pytest
        try:
            real = Path.rename

            def rename(self, target):
                real(self, target)
                os.kill(os.getpid(), signal.SIGKILL)

            pathlib.Path.rename = rename
            engine.save_checkpoint(root, tag="last")
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert read_full(root, None) in (old, new)  # before 55d347e: CheckpointError: .../ckpt/last: missing
    engine.save_checkpoint(root, tag="next")  # cleans up after the killed save
    assert read_full(root, "last") in (old, new) and not list(root.glob(".old-*")) + list(root.glob(".tmp-*"))
