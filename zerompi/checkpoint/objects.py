"""What a checkpoint reader may touch inside an HDF5 file, checked before any data is read.

HDF5 can make a read leave the file: an external link names another file, a
virtual dataset maps other files' datasets, external raw storage keeps a
dataset's bytes in any file of the system (a FIFO there blocks the reader),
and a filter runs decoding code (a plugin, for filters HDF5 does not build in).
A soft link makes one name read another tensor. zerompi writes none of these:
every dataset is a contiguous, unfiltered block of the file it is named in,
reached through hard links only. So before reading, every object is checked to
be exactly that, its declared size to fit in the file (a dataset declaring 2^40
elements is refused, not allocated), and every attribute's type and shape.
"""
from __future__ import annotations

import os

import h5py
import numpy as np

from zerompi.errors import CheckpointError

#: HDF5 filters a checkpoint dataset may use: zerompi writes none (schema.write_array)
ALLOWED_FILTERS: frozenset[int] = frozenset()
_LAYOUTS = {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.CHUNKED: "chunked"}
_NUMERIC = "biuf"  # bool, signed, unsigned, float: the only element kinds zerompi writes


def refuse(obj_file: str, name: str, reason: str) -> CheckpointError:
    return CheckpointError(f"{obj_file}: {name}: {reason}: refused before reading any data "
                           "(a checkpoint is read only from its own files)")


def _hard(group: h5py.Group, part: str, filename: str, path: str) -> bool:
    """Whether ``group`` has a hard link ``part`` (False when missing); any other link is refused."""
    link = group.get(part, getlink=True)
    if link is None:
        return False
    if isinstance(link, h5py.SoftLink):
        raise refuse(filename, path, f"is a soft link to {link.path}")
    if isinstance(link, h5py.ExternalLink):
        raise refuse(filename, path, f"is an external link to {link.filename}:{link.path}")
    if not isinstance(link, h5py.HardLink):
        raise refuse(filename, path, f"is a {type(link).__name__}, not a hard link")
    return True


def _follow(group: h5py.Group, name: str):
    """``group[name]`` through hard links only, or None when some component is missing."""
    filename, obj, path = group.file.filename, group, ""
    for part in name.strip("/").split("/"):
        path = f"{path}/{part}" if path else part
        if not isinstance(obj, h5py.Group):
            raise refuse(filename, path, f"{obj.name} is not a group")
        if not _hard(obj, part, filename, path):
            return None
        obj = obj[part]
    return obj


def exists(group: h5py.Group, name: str) -> bool:
    """Whether ``name`` exists, without following any link but hard ones."""
    return _follow(group, name) is not None


def dataset(group: h5py.Group, name: str) -> h5py.Dataset:
    """``group[name]``, checked to be a dataset stored plainly in this file (see the module)."""
    obj = _follow(group, name)
    filename = group.file.filename
    if obj is None:
        raise CheckpointError(f"{filename}: missing dataset {name}")
    if not isinstance(obj, h5py.Dataset):
        raise refuse(filename, name, f"is a {type(obj).__name__}, not a dataset")
    check_storage(obj, name)
    return obj


def check_storage(ds: h5py.Dataset, name: str) -> None:
    """Refuse virtual datasets, external raw storage, filters, non-numeric types and sizes beyond the file."""
    filename = ds.file.filename
    if ds.is_virtual:
        raise refuse(filename, name, "is a virtual dataset (its data would come from other files)")
    dcpl = ds.id.get_create_plist()
    if dcpl.get_external_count():
        target = dcpl.get_external(0)[0].decode(errors="replace")
        raise refuse(filename, name, f"keeps its data in external files ({target})")
    layout = dcpl.get_layout()
    if layout not in _LAYOUTS:
        raise refuse(filename, name, f"has storage layout {layout}; only contiguous or chunked is read")
    for i in range(dcpl.get_nfilters()):
        code, _flags, _values, fname = dcpl.get_filter(i)
        if code not in ALLOWED_FILTERS:
            raise refuse(filename, name, f"uses filter {code} ({fname.decode(errors='replace')}); "
                         "zerompi writes unfiltered datasets")
    dtype = ds.dtype
    if dtype.kind not in _NUMERIC or dtype.fields is not None or dtype.subdtype is not None:
        raise refuse(filename, name, f"has element type {dtype}, not a number")
    declared = int(np.prod(ds.shape, dtype=object)) * dtype.itemsize
    size = os.path.getsize(ds.file.filename)
    if declared > size:
        raise refuse(filename, name, f"declares {ds.shape} x {dtype} = {declared} bytes, more than the whole "
                     f"file ({size} bytes)")
    if layout == h5py.h5d.CONTIGUOUS and ds.id.get_storage_size() != declared:
        raise refuse(filename, name, f"stores {ds.id.get_storage_size()} of its {declared} bytes")


def check_shape(ds: h5py.Dataset, name: str, shape: tuple[int, ...], dtype: str | None = None) -> None:
    """Refuse ``ds`` unless it has ``shape`` (-1: any length) and, when given, element type ``dtype``."""
    if len(ds.shape) != len(shape) or any(w not in (-1, g) for w, g in zip(shape, ds.shape)):
        want = tuple("any" if w == -1 else w for w in shape)
        raise CheckpointError(f"{ds.file.filename}: {name}: shape {ds.shape}, expected {want} "
                              "(from the checkpoint's index): refused before reading it")
    if dtype is not None and ds.dtype != np.dtype(dtype):
        raise CheckpointError(f"{ds.file.filename}: {name}: element type {ds.dtype.str}, expected "
                              f"{np.dtype(dtype).str}: refused before reading it")


def attr(obj, name: str, kind: str, shape: tuple[int, ...] = ()):
    """Attribute ``name`` of ``obj`` if present (else None), after checking its type and shape:
    ``kind`` 'text' (fixed-length bytes), 'int', or a numpy dtype string for arrays."""
    where = f"{obj.file.filename}: {obj.name}"
    if name not in obj.attrs:
        return None
    aid = obj.attrs.get_id(name)
    dtype, got = aid.dtype, tuple(aid.shape or ())
    if kind == "text":
        ok = dtype.kind == "S" and dtype.itemsize <= 256
    elif kind == "int":
        ok = dtype.kind in "iu" and dtype.itemsize <= 8
    else:
        ok = dtype == np.dtype(kind)
    if not ok or got != shape:
        raise CheckpointError(f"{where}: attribute {name!r} is {dtype} {got}, expected {kind} {shape}: "
                              "refused before reading it")
    return obj.attrs[name]


def walk(group: h5py.Group, prefix: str = "") -> list[str]:
    """Every dataset under ``group`` (paths relative to it), refusing any link that is not hard."""
    out: list[str] = []
    for part in group:
        path = f"{prefix}{part}"
        _hard(group, part, group.file.filename, path)
        obj = group[part]
        if isinstance(obj, h5py.Group):
            out += walk(obj, path + "/")
        elif isinstance(obj, h5py.Dataset):
            out.append(path)
        else:
            raise refuse(group.file.filename, path, f"is a {type(obj).__name__}")
    return out


def check_file(f: h5py.File) -> None:
    """Check every link and dataset of ``f`` as :func:`dataset` does; run on opening, before any read."""
    for name in walk(f):
        check_storage(f[name], name)
