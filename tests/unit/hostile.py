"""Hand-crafted checkpoint files: HDF5 structures that make a read leave the checkpoint, and
checksummed data moved between tensors, ranks or saves (used by test_fuzz_checkpoint.py).

Each function changes a copy of a checkpoint under ``root`` in place. Whatever it puts
outside the checkpoint goes to ``outside(root)``, a sibling directory of ``root``; with
``fifo=True`` that target is a FIFO, so that a reader opening it blocks (the tests load in
a worker process with a time limit: a reader that opens it shows up as a hang).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import numpy as np

FILTERS = {"fletcher32": dict(fletcher32=True), "gzip": dict(compression="gzip"),
           "lzf": dict(compression="lzf"), "shuffle": dict(shuffle=True, compression="gzip")}


def outside(root: Path) -> Path:
    d = root.parent / f"{root.name}-outside"
    d.mkdir(exist_ok=True)
    return d


def _target(root: Path, name: str, fifo: bool, content: bytes | None = None) -> Path:
    path = outside(root) / name
    if fifo:
        os.mkfifo(path)
    elif content is not None:
        path.write_bytes(content)
    return path


def _take(f: h5py.File, name: str) -> tuple[np.ndarray, dict]:
    """Read and delete dataset ``name``, returning its data and attributes."""
    data, attrs = f[name][()], dict(f[name].attrs)
    del f[name]
    return data, attrs


def _put(f: h5py.File, name: str, data: np.ndarray, attrs: dict, **kwargs) -> None:
    f.create_dataset(name, data=data, **kwargs)
    f[name].attrs.update(attrs)


def soft_link(root: Path, file: str, name: str, other: str) -> None:
    """``name`` becomes a soft link to ``other`` (a dataset of the same shape with valid checksums)."""
    with h5py.File(root / file, "a") as f:
        del f[name]
        f[name] = h5py.SoftLink("/" + other)


def hard_link(root: Path, file: str, name: str, other: str) -> None:
    """``name`` becomes a second hard link to ``other``'s dataset (the link itself is plain HDF5)."""
    with h5py.File(root / file, "a") as f:
        del f[name]
        f[name] = f[other]


def external_link(root: Path, file: str, name: str, fifo: bool = False) -> None:
    """``name`` becomes an external link to the same dataset of a copy of the file outside the root."""
    target = _target(root, Path(file).name, fifo)
    if not fifo:
        shutil.copyfile(root / file, target)
    with h5py.File(root / file, "a") as f:
        del f[name]
        f[name] = h5py.ExternalLink(str(target), "/" + name)


def virtual(root: Path, file: str, name: str, fifo: bool = False) -> None:
    """``name`` becomes a virtual dataset mapping the same dataset of a copy outside the root
    (its checksum attribute copied, so the data would verify)."""
    target = _target(root, Path(file).name, fifo)
    if not fifo:
        shutil.copyfile(root / file, target)
    with h5py.File(root / file, "a") as f:
        shape, dtype = f[name].shape, f[name].dtype
        _, attrs = _take(f, name)
        layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
        layout[:] = h5py.VirtualSource(str(target), "/" + name, shape=shape, dtype=dtype)
        f.create_virtual_dataset(name, layout)
        f[name].attrs.update(attrs)


def external_storage(root: Path, file: str, name: str, fifo: bool = False) -> None:
    """``name``'s bytes move to a raw file outside the root (HDF5 external storage), checksums kept."""
    with h5py.File(root / file, "a") as f:
        data, attrs = _take(f, name)
        raw = _target(root, f"{Path(file).stem}-{name.replace('/', '_')}.raw", fifo, data.tobytes())
        f.create_dataset(name, shape=data.shape, dtype=data.dtype, external=[(str(raw), 0, data.nbytes)])
        f[name].attrs.update(attrs)


def filtered(root: Path, file: str, name: str, how: str) -> None:
    """``name`` rewritten through an HDF5 filter (same values, checksums kept)."""
    with h5py.File(root / file, "a") as f:
        data, attrs = _take(f, name)
        _put(f, name, data, attrs, chunks=True, **FILTERS[how])


def huge(root: Path, file: str, name: str) -> None:
    """``name`` declares 2^40 elements (nothing allocated in the file), its checksum attribute kept."""
    with h5py.File(root / file, "a") as f:
        data, attrs = _take(f, name)
        f.create_dataset(name, shape=(1 << 40,), dtype=data.dtype)
        f[name].attrs.update(attrs)


def swap_tensors(root: Path, file: str, name: str, other: str) -> None:
    """Two datasets of one file trade places, each with its own checksums."""
    with h5py.File(root / file, "a") as f:
        f.move(name, "swap.tmp")
        f.move(other, name)
        f.move("swap.tmp", other)


def swap_files(root: Path, file: str, other_file: Path, name: str) -> None:
    """Dataset ``name`` trades places between ``file`` and ``other_file`` (another rank's file,
    or the same rank's file of another save), each with its own checksums."""
    with h5py.File(root / file, "a") as f, h5py.File(other_file, "a") as g:
        mine, theirs = _take(f, name), _take(g, name)
        _put(f, name, *theirs)
        _put(g, name, *mine)


def symlink_out(root: Path, path: str) -> None:
    """``root/path`` (a tag directory, ``latest`` or one file of a tag) moves outside the root and a
    symbolic link to it takes its place."""
    src = root / path
    dst = outside(root) / path.replace("/", "_")
    shutil.move(src, dst)
    src.symlink_to(dst)
