"""The machinery of the checkpoint fuzzer (test_fuzz_checkpoint.py): small models and engines, pristine
checkpoints ("bases"), mutations of their bytes and structure, the two loads of a damaged copy, and the
long-lived load worker (``python -m tests.unit.checkpoint.fuzzing``) that runs those loads out of process.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import re
import shutil
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import torch
from hypothesis import strategies as st
from torch import nn

import zerompi
from tests.unit import hostile
from zerompi.checkpoint import load_full_state_dict
from zerompi.errors import CheckpointError
from zerompi.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[3]
HANG_S = 15      # one load of these few-KiB files takes milliseconds; longer is a hang
STARTUP_S = 180  # the load worker imports torch (slow on a busy machine)


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
# ... or (the "whole" base) Adafactor's state per tensor (t/states, the index's tensor_states).
WHOLE = dict(stage=2, optimizer="torch.optim.Adafactor")


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
        for name, _, state in engine.optimizer.tensor_states(i):  # whole-tensor groups: per tensor
            out.update({f"tensor/{name}/{k}": _bits(v) for k, v in state.items()})
    for gi, g in enumerate(inner.param_groups):
        for k, v in g.items():
            if k != "params":
                out[f"group/{gi}/{k}"] = repr(v)
    for i, residual in engine.sharded.residuals():
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
    elif name == "whole":  # Adafactor: its factored state saved per tensor
        base = Base(name, root, lambda: zerompi.initialize(Net(), one_config(**WHOLE)), world=1)
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


def write_one(root: Path, frozen: bool = False, whole: bool = False) -> None:
    """Single-process stage-3 engine: train 2 steps, save `prev`, train 1, save `good` (latest).
    ``frozen``: fc1's bias frozen, bf16 (its shard stored as raw bf16 bits), and `prev` without it;
    else with quantized gradients and error feedback (the residuals are saved too); ``whole``: Adafactor
    at stage 2 (its state is saved per tensor)."""
    config = dict(dtype="bf16") if frozen else WHOLE if whole else FEEDBACK
    engine = zerompi.initialize(Net(freeze_bias=frozen), one_config(**config))
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
            self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", __name__], cwd=ROOT,
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


if __name__ == "__main__":
    serve()
