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
a long-lived worker process (fuzzing.py holds it, the bases and the mutations) with a per-load time limit, so that a segfault or an
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

import faulthandler
import gc
import json
import os
import pathlib
import re
import shutil
import signal
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch

from tests.components import require_module, unavailable  # noqa: E402

require_module("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import zerompi  # noqa: E402
from zerompi.errors import CheckpointError  # noqa: E402
from tests.unit import hostile  # noqa: E402
from tests.unit.checkpoint.fuzzing import (HANG_S, Base, HypothesisDraw, LoadWorker, Mutation, Net,  # noqa: E402
                                           Result, _DTYPES, _bits, draw_flip, draw_truncate, engine_state,
                                           examine, gpt_config, make_gpt, one_config, prepare_base, read_full,
                                           WHOLE, write_one, write_two)

FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

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
    write_one(top / "whole", whole=True)
    out = {name: prepare_base(name, top / name) for name in ("one", "frozen", "whole")}
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
WHOLE_VARIANTS = [  # Adafactor at stage 2, its state per tensor: other stages reshard it, AdamW is refused
    ({}, dict(WHOLE, stage=3), True), ({}, dict(WHOLE, stage=1), True), ({}, dict(WHOLE, stage=0), True),
    ({}, dict(stage=2), False), (dict(extra=True), WHOLE, False),
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
    variants = {"one": ONE_VARIANTS, "frozen": FROZEN_VARIANTS, "whole": WHOLE_VARIANTS, "two": TWO_VARIANTS}[base.name]
    model_kw, cfg_kw, loads = d.choice(variants)
    if base.name in ("one", "whole"):
        engine = zerompi.initialize(Net(**model_kw), one_config(**cfg_kw))
    elif base.name == "frozen":
        engine = zerompi.initialize(Net(**{"freeze_bias": True, **model_kw}), one_config(**cfg_kw))
    else:
        engine = zerompi.initialize(make_gpt(**model_kw), gpt_config(**cfg_kw))
    faulthandler.dump_traceback_later(HANG_S * 4, exit=True)  # in this process: a hang ends the whole run
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
