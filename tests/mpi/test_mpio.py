"""The shared-file checkpoint layout, written through h5py's mpio driver by real MPI jobs.

PyPI's h5py is serial, so the writing jobs run in a second venv made by
jobs/ci/parallel_h5py.sh: Debian's parallel h5py and mpi4py (Open MPI) under
Debian's python3, started with mpiexec.openmpi. Reading needs no MPI-IO: the
loading jobs of the main venv (PyPI h5py, MPICH) resume the same files, which
is the promise that one loader reads both layouts.
"""
from __future__ import annotations

import json
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from zerompi.checkpoint import load_full_state_dict
from zerompi.checkpoint.shared import SHARED

from ..components import MISSING, ran, unavailable
from .launcher import ROOT, WORKERS, mpi_env, rank_python, run_mpi
from .tolerance import check_resume

VENV = ROOT / ".venv-mpio"


@pytest.fixture(scope="module")
def mpio():
    """The parallel-h5py venv's python (built the first time, ~20 s with the packages cached)."""
    proc = subprocess.run(["bash", "jobs/ci/parallel_h5py.sh", str(VENV)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode == 3:
        unavailable("parallel HDF5", proc.stderr.strip().splitlines()[-1])
    if proc.returncode != 0:
        MISSING["parallel HDF5"] = f"jobs/ci/parallel_h5py.sh exited {proc.returncode}"
        pytest.fail(f"jobs/ci/parallel_h5py.sh exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    python = VENV / "bin" / "python"
    build = _openmpi_job(python, 1, "-c", "import h5py, mpi4py.MPI as M; print(f'HDF5 {h5py.version.hdf5_version},"
                         " h5py {h5py.__version__}, mpi={h5py.get_config().mpi}, under',"
                         " M.Get_library_version().split(',')[0])")
    assert "mpi=True" in build.stdout, build.stdout
    ran("parallel HDF5", build.stdout)
    return python


def _openmpi_job(python, n: int, *args: str) -> subprocess.CompletedProcess:
    """ckpt.py with ``args`` (or ``-c CODE``) on ``n`` ranks under Debian's Open MPI."""
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_MCA_", "PMI_", "MPIR_"))}
    script = list(args) if args[0] == "-c" else ["-m", "mpi4py", str(WORKERS / "ckpt.py"), *args]
    launcher = shutil.which("mpiexec.openmpi") or "mpiexec.openmpi"
    # Debian's h5py picks its MPI build at import by the launcher's variables: each rank imports it itself
    cmd = [launcher, "--oversubscribe", "-n", str(n), *rank_python(python, ("-h5py",), launcher=launcher), *script]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def shared_ckpt(mpio, tmp_path_factory):
    """np 2, stage 3, AdamW, checkpoint_layout='auto' (shared, since this h5py has MPI)."""
    tmp = tmp_path_factory.mktemp("mpio")
    _openmpi_job(mpio, 2, "--mode", "save", "--root", str(tmp / "root"), "--out", str(tmp / "a.npz"))
    return tmp / "root", np.load(tmp / "a.npz")


def test_auto_writes_one_shared_file(shared_ckpt):
    root, _ = shared_ckpt
    tag = (root / "latest").read_text().strip()
    assert sorted(p.name for p in (root / tag).iterdir()) == ["index.h5", SHARED]
    with h5py.File(root / tag / SHARED) as f:  # plain HDF5 for a serial h5py
        assert f.attrs["world_size"] == 2
        master = [n for n in f if n.startswith("b")]
        assert master and all(f[f"{b}/master"].shape[0] % 2 == 0 for b in master)
        assert f[f"crc/{master[0]}/master"].shape[0] == 2  # one checksum row per writing rank


@pytest.mark.parametrize("n,stage,venv", [(2, 3, "main"), (3, 2, "mpio"), (1, 0, "main")])
def test_shared_file_resumes(mpio, shared_ckpt, tmp_path, n, stage, venv):
    root, a = shared_ckpt
    args = ("--mode", "resume", "--root", str(root), "--out", str(tmp_path / "b.npz"),
            "--stage", str(stage), "--model-seed", "9", *(() if (n, stage) == (2, 3) else ("--orders",)))
    if venv == "main":  # serial h5py under MPICH reads what Open MPI's MPI-IO wrote
        run_mpi(n, "ckpt.py", *args)
    else:
        _openmpi_job(mpio, n, *args)
    b = dict(np.load(tmp_path / "b.npz"))
    for key in (k for k in a.files if k.startswith("saved/")):
        assert np.array_equal(a[key], b[key]), f"{key} differs right after loading"
    finals = [k for k in a.files if k.startswith("final/")]
    if (n, stage) == (2, 3):
        assert all(np.array_equal(a[k], b[k]) for k in finals)
    else:
        check_resume(dict(a), b, "fp32")


@pytest.mark.parametrize("layout", ["shared", "per_node"])
def test_whole_tensor_state_in_the_layouts_that_write_every_rank_together(mpio, tmp_path, layout):
    """Adafactor keeps its state per tensor, on owners (checkpoint/tensors.py): every rank writes it as one
    dataset of one length, so the shared file (written collectively) and the per-node file (gathered)
    take it like any other. Saved at 2 ranks, resumed at 2 in the main venv: bitwise."""
    save = ("--mode", "save", "--root", str(tmp_path / "root"), "--out", str(tmp_path / "a.npz"),
            "--optimizer", "adafactor", "--layout", layout)
    if layout == "shared":
        _openmpi_job(mpio, 2, *save)
    else:
        run_mpi(2, "ckpt.py", *save, "--ranks-per-node", "2")
    tag = (tmp_path / "root" / "latest").read_text().strip()
    written = sorted(p.name for p in (tmp_path / "root" / tag).iterdir())
    assert written == (["index.h5", SHARED] if layout == "shared" else ["index.h5", "node00000.h5"]), written
    run_mpi(2, "ckpt.py", "--mode", "resume", "--root", str(tmp_path / "root"), "--out", str(tmp_path / "b.npz"),
            "--optimizer", "adafactor", "--model-seed", "9")
    a, b = np.load(tmp_path / "a.npz"), dict(np.load(tmp_path / "b.npz"))
    for key in (k for k in a.files if k.startswith(("saved/", "final/"))):
        assert np.array_equal(a[key], b[key]), f"{key} differs"


def test_shared_file_consolidates_and_inspects(shared_ckpt, tmp_path):
    root, a = shared_ckpt
    full = load_full_state_dict(root)
    for name in full:
        assert np.array_equal(full[name].numpy(), a[f"saved/{name}"]), name
    full.close()
    proc = subprocess.run([*rank_python(), "-m", "zerompi.tools.cli", "ckpt", "inspect", "--json", str(root)],
                          capture_output=True, text=True, env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)[0]
    assert report["layout"] == "shared" and report["checksums"].startswith("ok"), report


def _flip_in_rank_part(path, dataset: str, rank: int, world: int) -> None:
    with h5py.File(path) as f:
        ds = f[dataset]
        offset = ds.id.get_offset() + ds.dtype.itemsize * (rank * ds.shape[0] // world + 1)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))


def test_corrupt_shared_file_is_named_on_every_rank(shared_ckpt, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(shared_ckpt[0], root)
    tag = (root / "latest").read_text().strip()
    _flip_in_rank_part(root / tag / SHARED, "b0/master", 1, 2)
    run_mpi(3, "ckpt.py", "--mode", "fail", "--root", str(root), "--out", str(tmp_path / "e.json"))
    messages = json.loads((tmp_path / "e.json").read_text())
    assert len(messages) == 3 and all(m.startswith("CheckpointError") for m in messages), messages
    assert all(SHARED in m and "b0/master" in m and "checksum mismatch" in m for m in messages), messages
    proc = subprocess.run([*rank_python(), "-m", "zerompi.tools.cli", "ckpt", "inspect", str(root)],
                          capture_output=True, text=True, env=mpi_env())
    assert proc.returncode == 1 and "CORRUPT" in proc.stdout and "rank 1's part" in proc.stdout, proc.stdout


def test_hsdp_writes_one_node_and_per_rank_stays_selectable(mpio, tmp_path):
    # hsdp: only the first node's shard group writes, collectively over that group's communicator.
    _openmpi_job(mpio, 4, "--mode", "save", "--root", str(tmp_path / "h"), "--out", str(tmp_path / "a.npz"),
                 "--hierarchy", "hsdp", "--ranks-per-node", "2")
    _openmpi_job(mpio, 2, "--mode", "save", "--root", str(tmp_path / "p"), "--out", str(tmp_path / "p.npz"),
                 "--layout", "per_rank")
    tag = "step00000003"
    with h5py.File(tmp_path / "h" / tag / SHARED) as f:
        assert f.attrs["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "p" / tag).iterdir()) == ["index.h5", "rank00000.h5", "rank00001.h5"]
    run_mpi(3, "ckpt.py", "--mode", "resume", "--root", str(tmp_path / "h"), "--out", str(tmp_path / "b.npz"),
            "--model-seed", "9")
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a.files if k.startswith("saved/"))


@pytest.mark.skipif(h5py.get_config().mpi, reason="this h5py has MPI")
def test_shared_without_parallel_h5py_is_refused_up_front():
    from zerompi import UsageError, ZeroConfig
    from zerompi.checkpoint.stores import store_for
    with pytest.raises(UsageError, match="checkpoint_layout='shared' needs h5py built with MPI"):
        store_for(ZeroConfig(checkpoint_layout="shared").checkpoint_layout)
    assert store_for(ZeroConfig().checkpoint_layout).kind == "per_rank"


def test_async_save_writes_per_rank_files_with_auto(mpio, tmp_path):
    """An asynchronous save makes no MPI call on its thread: with 'auto' it writes per-rank files even
    where h5py could write the shared one, and the main venv resumes them."""
    root = tmp_path / "root"
    _openmpi_job(mpio, 2, "--mode", "save", "--root", str(root), "--out", str(tmp_path / "a.npz"), "--async-save")
    tag = (root / "latest").read_text().strip()
    assert sorted(p.name for p in (root / tag).iterdir()) == ["index.h5", "rank00000.h5", "rank00001.h5"]
    run_mpi(2, "ckpt.py", "--mode", "resume", "--root", str(root), "--out", str(tmp_path / "b.npz"), "--model-seed", "9")
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    for key in a.files:
        assert np.array_equal(a[key], b[key]), key
