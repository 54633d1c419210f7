"""HDF5 names, format version, and checksummed datasets of a zerompi checkpoint.

A checkpoint is a directory ``ROOT/TAG/`` holding ``index.h5`` (what the
tensors are: names, shapes, the bucket layout that wrote them, the config,
counters, client state) and one ``rankNNNNN.h5`` per writing rank (that
rank's fp32 master shards, optimizer state and RNG state), or all of those
in one ``shards.h5`` written collectively (shared.py). ``ROOT/latest``
names the newest complete tag. Only numbers, strings and JSON are stored:
loading never unpickles anything.

Every dataset carries one CRC-32 per block of ``CRC_BLOCK`` elements, so a
reader that needs only a slice (resharding) still verifies every byte it uses.
"""
from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import h5py
import numpy as np

from zerompi.errors import CheckpointError

FORMAT = "zerompi-checkpoint"
VERSION = 1
INDEX = "index.h5"
LATEST = "latest"
CRC_BLOCK = 1 << 20  # elements per checksum block
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


# Dataset names: every module reads and writes them through these, and nowhere else spells them.
CPU_RNG, CUDA_RNG, CUDA_DEVICES = "rng/torch_cpu", "rng/torch_cuda", "rng/cuda_device_count"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.h5"


def master(bucket: int) -> str:
    """Bucket ``bucket``'s fp32 master shard (in a rank file, or a writer's part of shards.h5)."""
    return f"b{bucket}/master"


def state(bucket: int, key: str) -> str:
    """Bucket ``bucket``'s per-element optimizer state ``key`` (e.g. exp_avg)."""
    return f"b{bucket}/state/{key}"


def replicated(name: str) -> str:
    """A frozen parameter or buffer, whole, in index.h5."""
    return f"replicated/{name}"


def shared_crc(name: str) -> str:
    """The (writers, blocks) checksum rows of dataset ``name`` in shards.h5."""
    return f"crc/{name}"


SHARED_CRC_PREFIX = shared_crc("")


def check_tag(tag: str, source: str = "tag") -> str:
    """A tag is one plain path component: it can never point outside the checkpoint root."""
    if not isinstance(tag, str) or not _TAG.match(tag) or tag in (".", ".."):
        raise CheckpointError(f"{source} {tag!r} is not a valid checkpoint tag "
                              "(letters, digits, '.', '_', '-'; no path separators; not starting with '.')")
    return tag


def _crc(chunk: np.ndarray, dtype: np.dtype) -> int:
    # Seeded with the datatype, so a damaged datatype (byte order, signedness) fails the check
    # even though the bytes are intact: the same bytes would be read as other numbers.
    return zlib.crc32(np.ascontiguousarray(chunk).view(np.uint8), zlib.crc32(dtype.str.encode()))


def block_crcs(flat: np.ndarray) -> np.ndarray:
    """CRC-32 of each ``CRC_BLOCK``-element block of a 1-D array."""
    n = flat.shape[0]
    out = np.empty(max(1, -(-n // CRC_BLOCK)), dtype=np.uint32)
    for i in range(out.shape[0]):
        out[i] = _crc(flat[i * CRC_BLOCK:(i + 1) * CRC_BLOCK], flat.dtype)
    return out


def write_array(group: h5py.Group, name: str, data: np.ndarray) -> None:
    """Write a 1-D array with its block checksums."""
    flat = np.ascontiguousarray(data).reshape(-1)
    ds = group.create_dataset(name, data=flat)
    ds.attrs["crc32"] = block_crcs(flat)


def read_array(ds: h5py.Dataset, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Read ``ds[start:stop]``, verifying the checksum of every block it touches."""
    n = ds.shape[0]
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise CheckpointError(f"{ds.file.filename}:{ds.name}: range [{start}, {stop}) outside [0, {n})")
    crcs = ds.attrs.get("crc32")
    if crcs is None:
        raise CheckpointError(f"{ds.file.filename}:{ds.name}: no checksum attribute")
    first, last = start // CRC_BLOCK, max(start, stop - 1) // CRC_BLOCK
    lo, hi = first * CRC_BLOCK, min(n, (last + 1) * CRC_BLOCK)
    try:
        data = ds[lo:hi]
    except (OSError, RuntimeError) as e:  # truncated or damaged file
        raise CheckpointError(f"{ds.file.filename}:{ds.name}: unreadable ({e})") from e
    for b in range(first, last + 1 if hi > lo else first):
        chunk = data[(b - first) * CRC_BLOCK:(b - first + 1) * CRC_BLOCK]
        if b >= len(crcs) or _crc(chunk, ds.dtype) != int(crcs[b]):
            raise CheckpointError(f"{ds.file.filename}:{ds.name}: checksum mismatch in elements "
                                  f"[{b * CRC_BLOCK}, {min(n, (b + 1) * CRC_BLOCK)}): the file is corrupt")
    return data[start - lo:stop - lo]


def write_json(group: h5py.Group, name: str, obj) -> None:
    """JSON text as a string dataset (attributes are limited to 64 KiB), checksummed."""
    raw = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), dtype=np.uint8)
    write_array(group, name, raw)


def read_json(group: h5py.Group, name: str, where: str):
    if name not in group:
        raise CheckpointError(f"{where}: missing {group.name.rstrip('/')}/{name}")
    raw = read_array(group[name])
    try:
        return json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: {name} is not valid JSON ({e})") from e


def open_h5(path: Path, mode: str = "r") -> h5py.File:
    """Open an HDF5 file, turning any failure into a CheckpointError naming it."""
    try:
        return h5py.File(path, mode)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing") from e
    except OSError as e:
        raise CheckpointError(f"{path}: not a readable HDF5 file ({e})") from e


def text_attr(value: str) -> np.bytes_:
    """A fixed-length string attribute: stored inline, never in HDF5's global heap, whose
    damaged object sizes can make HDF5 loop forever when the attribute is read."""
    return np.bytes_(value.encode())


def check_header(f: h5py.File, kind: str) -> None:
    if f.attrs.get("format") != text_attr(FORMAT) or f.attrs.get("kind") != text_attr(kind):
        raise CheckpointError(f"{f.filename}: not a zerompi {kind} file")
    version = int(f.attrs.get("version", -1))
    if version != VERSION:
        raise CheckpointError(f"{f.filename}: format version {version}, this zerompi reads {VERSION}")


def write_header(f: h5py.File, kind: str) -> None:
    f.attrs["format"] = text_attr(FORMAT)
    f.attrs["kind"] = text_attr(kind)
    f.attrs["version"] = VERSION


#: what h5py raises on a damaged file (besides our own CheckpointError, a RuntimeError)
H5_ERRORS = (OSError, RuntimeError, KeyError, TypeError, ValueError, IndexError, AttributeError)


def damaged(where: str, e: Exception) -> CheckpointError:
    """The CheckpointError for an h5py failure on a damaged file."""
    return CheckpointError(f"{where}: damaged or unreadable ({type(e).__name__}: {e})")
