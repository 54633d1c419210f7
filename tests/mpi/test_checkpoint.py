"""Checkpoints across real jobs: exact resume, resharding, corruption, atomicity, consolidation.

Each resume test runs two cases of workers/ckpt.py: the first trains 3 steps, saves,
and trains 3 more; the second, in a later job, starts from a model with different
initial values, loads, and trains the same 3 steps. At the same world size and stage the
result must be bitwise identical; at another world size or stage, the loaded
state must be bitwise identical and the 3 further steps agree within the
parity bound of tolerance.py: only the order of the sums over ranks differs, so
the resumed job also trains those steps with the global batch's rows reordered,
and its distance from the saving job must stay within ORDER_K times what the
reordering moved.

The module's ckpt.py cases run several to a job, as few jobs as world sizes and dependencies allow
(tests/mpi/batch.py): starting a job costs more than a case.
"""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from zerompi.checkpoint import consolidate, load_full_state_dict

from .batch import Batch, run_planned, selected
from .launcher import ROOT, TIMEOUT, mpi_env, rank_python, run_mpi, run_worker_json
from .tolerance import check_resume

RESUMES = [  # (np save, stage save) -> (np load, stage load), dtype, optimizer
    ((2, 3), (2, 3), "fp32", "adamw"),
    ((3, 1), (3, 1), "bf16", "adamw"),
    ((2, 2), (2, 2), "fp16", "adamw"),
    ((4, 1), (2, 3), "fp32", "adamw"),
    ((3, 2), (1, 0), "fp32", "sgd"),
    ((1, 0), (6, 2), "fp32", "adamw"),
    ((6, 3), (4, 1), "bf16", "sgd"),
]  # 1 -> 6 and 6 -> 4 ranks: as many shard boundaries moved as 8 ranks would, at three quarters of the cost.
# Every stage is saved and loaded, each dtype and optimizer runs; test_reproducible.py adds 4 -> 3 and 3 -> 5
# at stages 0-3 (bitwise there), so 4 -> 3 at stage 2, 2 -> 5 at stage 3 and 1 -> 1 at stage 0 are not repeated.


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The workers/ckpt.py runs of the module's selected tests, as few jobs as world sizes and
    dependencies allow (tests/mpi/batch.py), instead of a job or two per test. ``jobs(request)``
    raises the test's own cases' failures and returns its directory."""
    batch = Batch("ckpt.py", tmp_path_factory)
    saved = tmp_path_factory.mktemp("ckpt") / "root"
    if any("saved" in i.fixturenames for i in selected(request)):
        for tag, before in (("first", 2), ("second", 3)):  # a 2-rank stage-3 root, second the latest
            batch.add(f"saved/{tag}", 2, "--mode", "save", "--root", saved, "--out", saved.parent / f"{tag}.npz",
                      "--before", before, "--after", "0", "--tag", tag)
    ran = run_planned(request, batch, PLANS, saved)
    ran.batch, ran.saved = batch, saved
    return ran


SAVED = ("saved/first", "saved/second")


@pytest.fixture(scope="module")
def saved(jobs):
    for name in SAVED:
        jobs.batch.check(name)
    return jobs.saved


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _resume(add, where, saved, save, load, dtype, optimizer):
    common = ("--root", where / "ckpt", "--dtype", dtype, "--optimizer", optimizer)
    first = add(save[0], "--mode", "save", "--out", where / "a.npz", "--stage", save[1], *common)
    add(load[0], "--mode", "resume", "--out", where / "b.npz", "--stage", load[1], "--model-seed", "9", *common,
        *(() if save == load else ("--orders",)), after=[first])


@pytest.mark.parametrize("save,load,dtype,optimizer", RESUMES,
                         ids=[f"np{s[0]}s{s[1]}-to-np{l[0]}s{l[1]}-{d}-{o}" for s, l, d, o in RESUMES])
def test_resume(jobs, request, save, load, dtype, optimizer):
    tmp_path = jobs(request)
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    for key in a.files:
        if key.startswith("saved/"):
            assert np.array_equal(a[key], b[key]), f"{key} differs right after loading"
    finals = [k for k in a.files if k.startswith("final/")]
    assert finals and any(not np.array_equal(a[k], a[k.replace("final/", "saved/")]) for k in finals)
    if save == load:
        for key in finals:
            assert np.array_equal(a[key], b[key]), f"{key} differs after resuming"
    else:
        check_resume(a, b, dtype)


def _flip_byte_in_dataset(path, name):
    import h5py
    with h5py.File(path, "r") as f:
        offset = f[name].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x10]))


def _damaged(where, saved, damage):
    """A copy of ``saved`` damaged so: the words the error must hold."""
    root = _copy(saved, where / "root")
    target = root / "second" / "rank00001.h5"
    if damage == "flip":
        _flip_byte_in_dataset(target, "b0/master")
        return ["rank00001.h5", "b0/master", "checksum"]
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
        return ["rank00001.h5"]
    if damage == "missing_rank":
        target.unlink()
        return ["rank00001.h5", "missing"]
    (root / "latest").write_text("../../etc\n")
    return ["latest", "not a valid checkpoint tag"]


def _load_damaged(add, where, saved, damage):
    def prepare():
        (where / "expect.json").write_text(json.dumps(_damaged(where, saved, damage)))
    # the same 3-rank job then loads the previous checkpoint: untouched, and nothing half-loaded stops it
    add(3, "--mode", "fail", "--root", where / "root", "--out", where / "err.json", "--then-load", "first",
        "--then-out", where / "prev.npz", after=SAVED, prepare=prepare)


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing_rank", "latest_garbage"])
def test_damaged_checkpoint_is_named_on_every_rank_and_previous_loads(jobs, request, saved, damage):
    tmp_path = jobs(request)
    expect = json.loads((tmp_path / "expect.json").read_text())
    messages = json.loads((tmp_path / "err.json").read_text())
    assert len(messages) == 3
    for m in messages:
        assert m.startswith("CheckpointError"), messages
        for word in expect:
            assert word in m, (word, m)
    prev, first = np.load(tmp_path / "prev.npz"), np.load(saved.parent / "first.npz")
    for key in first.files:
        if key.startswith("saved/"):
            assert np.array_equal(prev[key], first[key])


def test_different_model_is_refused(jobs, request, saved):
    messages = json.loads((jobs(request) / "err.json").read_text())
    for m in messages:
        assert m.startswith("CheckpointError") and "different model" in m and "shape" in m, m


ASYNC = [(3, "fp32", "none", ()), (1, "bf16", "none", ("--async-copy",)), (2, "fp32", "nvme", ("--verify",))]


def _async(add, where, saved, stage, dtype, offload, flags):
    extra = ("--root", where / "ckpt", "--stage", stage, "--offload", offload, "--dtype", dtype)
    first = add(2, "--mode", "save", "--out", where / "a.npz", "--async-save", "--slow-capture", "0.3", *extra, *flags)
    add(2, "--mode", "resume", "--out", where / "b.npz", "--model-seed", "9", *extra, after=[first])


@pytest.mark.parametrize("stage,dtype,offload,flags", ASYNC, ids=[f"s{s}-{d}-{o}{''.join(f)}" for s, d, o, f in ASYNC])
def test_async_save_writes_the_state_of_the_call(jobs, request, stage, dtype, offload, flags):
    """save_checkpoint(async_save=True) returns at once and the next steps run while the save takes each
    bucket (slowed down: they reach buckets it has not taken yet); the checkpoint still holds the state
    of the call, bitwise, and a job resumed from it continues exactly as the saving job did."""
    tmp_path = jobs(request)
    root = tmp_path / "ckpt"
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert (root / "latest").read_text().strip() == "step00000003" and not list(root.glob(".tmp-*"))
    for key in a.files:
        assert np.array_equal(a[key], b[key]), f"{key} differs"
    assert any(not np.array_equal(a[k], a[k.replace("final/", "saved/")]) for k in a.files if k.startswith("final/"))


def test_async_save_captures_every_item_at_the_call(tmp_path):
    """With int4 gradients and error feedback, fp16 and a scheduler, an asynchronous save followed by two
    steps (and the data position advanced in place) loads back each captured item bitwise as it was at
    the call: residuals, loss scaler, scheduler, CPU RNG, step counter, client_state (workers/async_capture.py)."""
    rows = run_worker_json(2, "async_capture.py", tmp_path / "rows.json", "--root", str(tmp_path / "ckpt"))
    assert sorted((r["case"], r["rank"]) for r in rows) == [("s1", 0), ("s1", 1), ("s3", 0), ("s3", 1)]
    for r in rows:
        assert all(r["moved"].values()), r  # the steps after the call changed every item
        assert r["fence_waits"] > 0, r      # and ran while the save was taking the buckets
        assert all(r["same"].values()), r


def _failed_async(add, where, saved):
    add(3, "--mode", "save", "--root", where / "root", "--out", where / "err.json", "--fail-write-rank", "1",
        "--tag", "third", after=SAVED, prepare=lambda: _copy(saved, where / "root"))


def test_failed_async_save_is_reported_on_every_rank_and_latest_stays(jobs, request, saved):
    tmp_path = jobs(request)
    root = tmp_path / "root"
    messages = json.loads((tmp_path / "err.json").read_text())
    assert len(messages) == 3
    for m in messages:
        assert m.startswith("CheckpointError: asynchronous save of 'third' failed: rank 1: OSError"), m
        assert "No space left on device (test)" in m, m
    assert (root / "latest").read_text().strip() == "second" and not (root / "third").exists()


def _different(add, where, saved):
    add(2, "--mode", "fail", "--root", saved, "--out", where / "err.json", "--n-embd", "32", after=SAVED)


PLANS = {  # test -> add(world, *ckpt.py's arguments, after=..., prepare=...) for each of its cases
    "test_resume": _resume,
    "test_async_save_writes_the_state_of_the_call": _async,
    "test_damaged_checkpoint_is_named_on_every_rank_and_previous_loads": _load_damaged,
    "test_different_model_is_refused": _different,
    "test_failed_async_save_is_reported_on_every_rank_and_latest_stays": _failed_async,
}


KILL = """
import os, signal, sys
sys.path.insert(0, {workers!r})
import importlib
w = importlib.import_module("zerompi.checkpoint." + {module!r})
original = getattr(w, {point!r})
def die(*args, **kwargs):
    if {after}:
        original(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
setattr(w, {point!r}, die)
sys.argv = ["ckpt.py", "--mode", "save", "--root", {root!r}, "--out", {out!r}, "--before", "4",
            "--after", {steps!r}, "--tag", "third", *{extra!r}]
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""
KILLS = [  # (module, function, die after it ran, asynchronous save)
    ("writer", "_write_shards", False, False),   # before the rank file exists
    ("rawio", "fsync_path", False, False),       # rank file written, not yet fsynced
    ("writer", "write_index", False, False), ("writer", "_publish", False, False), ("writer", "_publish", True, False),
    # asynchronous: killed on the save's thread while the job trains on
    ("stores", "write_rank_file", False, True),  # before the rank file exists
    ("background", "_put_marker", False, True),  # rank file written and fsynced, its marker not yet
    ("writer", "write_index", False, True), ("writer", "_publish", False, True), ("writer", "_publish", True, True)]


@pytest.mark.parametrize("module,point,after,asynchronous", KILLS,
                         ids=[f"{m}.{p}{'-after' * a}{'-async' * s}" for m, p, a, s in KILLS])
def test_kill_during_save_keeps_latest_loadable(tmp_path, saved, module, point, after, asynchronous):
    """SIGKILL at each stage of a save: `latest` always names a complete, verified checkpoint."""
    root = _copy(saved, tmp_path / "root")
    workers = ROOT / "tests" / "mpi" / "workers"
    code = KILL.format(workers=str(workers), module=module, point=point, after=after, root=str(root),
                       out=str(tmp_path / "x.npz"), script=str(workers / "ckpt.py"),
                       steps="3" if asynchronous else "0", extra=["--async-save"] if asynchronous else [])
    proc = subprocess.run([*rank_python(fresh=True), "-c", code], env=mpi_env(), cwd=ROOT, capture_output=True,
                          timeout=TIMEOUT)
    assert proc.returncode == -9, proc.stderr[-2000:]
    latest = (root / "latest").read_text().strip()
    assert latest == ("third" if after else "second")
    full = dict(load_full_state_dict(root))  # reads and verifies every tensor of `latest`
    if latest == "second":
        ref = np.load(saved.parent / "second.npz")
        for name, value in full.items():
            assert np.array_equal(value.numpy(), ref[f"saved/{name}"])


def test_consolidate_and_inspect(tmp_path, saved):
    full = load_full_state_dict(saved)
    ref = np.load(saved.parent / "second.npz")
    for name in full:
        assert np.array_equal(full[name].numpy(), ref[f"saved/{name}"])
    h5 = consolidate(saved, tmp_path / "model.h5")
    st = consolidate(saved, tmp_path / "model.safetensors", tag="second")
    import h5py
    with h5py.File(h5) as f:
        for name in full:
            assert np.array_equal(f[name][()], ref[f"saved/{name}"])
    raw = st.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for name in full:
        lo, hi = header[name]["data_offsets"]
        value = np.frombuffer(raw[8 + n + lo:8 + n + hi], dtype="<f4").reshape(header[name]["shape"])
        assert np.array_equal(value, ref[f"saved/{name}"])
    cli = [*rank_python(), "-m", "zerompi.tools.cli", "ckpt", "inspect", str(saved), "--json"]
    report = json.loads(subprocess.run(cli, capture_output=True, text=True, check=True, cwd=ROOT,
                                       env=mpi_env()).stdout)
    assert [r["tag"] for r in report] == ["first", "second"]
    assert report[1]["latest"] and report[1]["world_size"] == 2 and report[1]["stage"] == 3
    assert report[1]["checksums"].startswith("ok")
    assert {t["name"] for t in report[1]["tensors"]} == set(full)


REPLACE_KILL = """
import os, pathlib, signal, sys
sys.path.insert(0, {workers!r})
rename = pathlib.Path.rename
def rename_or_die(self, target):
    if self.name.startswith(".tmp-"):  # the old copy is already aside; the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(self, target)
pathlib.Path.rename = rename_or_die
sys.argv = ["ckpt.py", "--mode", "save", "--root", {root!r}, "--out", {out!r}, "--before", "4",
            "--after", "0", "--tag", "second"]
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""


def test_kill_while_replacing_a_tag_keeps_it_loadable(tmp_path, saved):
    """Re-saving an existing tag moves the old copy aside first; a kill right then loses nothing,
    and the next save puts the old copy back before cleaning up."""
    root = _copy(saved, tmp_path / "root")
    workers = ROOT / "tests" / "mpi" / "workers"
    code = REPLACE_KILL.format(workers=str(workers), root=str(root), out=str(tmp_path / "x.npz"),
                               script=str(workers / "ckpt.py"))
    proc = subprocess.run([*rank_python(fresh=True), "-c", code], env=mpi_env(), cwd=ROOT, capture_output=True,
                          timeout=TIMEOUT)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not (root / "second").exists() and list(root.glob(".old-second-*"))
    ref = np.load(saved.parent / "second.npz")
    for name, value in dict(load_full_state_dict(root)).items():  # `latest` = second, found aside
        assert np.array_equal(value.numpy(), ref[f"saved/{name}"])
    run_mpi(1, "ckpt.py", "--mode", "save", "--root", str(root), "--out", str(tmp_path / "y.npz"),
            "--before", "1", "--after", "0", "--tag", "fourth")
    assert (root / "second").is_dir() and not list(root.glob(".old-*"))


def test_per_node_layout_over_mpi_loads_at_another_world_size(tmp_path):
    """4 MPI ranks as 2 emulated nodes write 2 node files (MPI_Gather to each node's first rank);
    3 ranks load them, and the per-rank layout's checkpoint, to the same bits (workers/scale_ckpt.py)."""
    run_mpi(4, "scale_ckpt.py", "--mode", "save", "--root", str(tmp_path), "--out", str(tmp_path / "a.npz"),
            "--ranks-per-node", "2")
    run_mpi(3, "scale_ckpt.py", "--mode", "load", "--root", str(tmp_path), "--out", str(tmp_path / "b.npz"))
    assert sorted(p.name for p in (tmp_path / "per_node" / "t").iterdir()) == [
        "index.h5", "node00000.h5", "node00001.h5"]
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    for key in a.files:
        assert np.array_equal(a[key], b[key]), key
    assert int(b["per_node/steps"]) == int(b["per_rank/steps"]) == 3
