"""HDF5 names, format version, and checksummed datasets of a zerompi checkpoint.

A checkpoint is a directory ``ROOT/TAG/`` holding ``index.h5`` (what the
tensors are: names, shapes, the bucket layout that wrote them, the config,
counters, client state) and one ``rankNNNNN.h5`` per writing rank (that
rank's fp32 master shards, optimizer state and RNG state), or all of those
in one ``shards.h5`` written collectively (shared.py). ``ROOT/latest``
names the newest complete tag. Only numbers, strings and JSON are stored:
loading never unpickles anything.

Every dataset carries one CRC-32 per block of ``CRC_BLOCK`` elements, so a
reader that needs only a slice (resharding) still verifies every byte it uses;
the checksums are bound to the tensor, writer and save (:class:`Binding`).
Before any data is read, objects.py checks that the dataset is stored plainly
in its own file, and paths.py that the file lies inside the checkpoint.
"""
from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from zerompi.checkpoint import objects, paths
from zerompi.checksum import crc32
from zerompi.errors import CheckpointError

FORMAT = "zerompi-checkpoint"
VERSION = 2  # 2: checksums bound to the dataset's name, writer rank, save and block (Binding)
READS = (1, 2)  # the versions this zerompi loads
INDEX = "index.h5"
LATEST = "latest"
CRC_BLOCK = 1 << 20  # elements per checksum block
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


# Dataset names: every module reads and writes them through these, and nowhere else spells them.
CPU_RNG, CUDA_RNG, CUDA_DEVICES = "rng/torch_cpu", "rng/torch_cuda", "rng/cuda_device_count"
TENSOR_STATES = "t/states"  # a rank's whole-tensor optimizer states, back to back (tensors.py)


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.h5"


def node_file(number: int) -> str:
    """The per-node layout's file ``number`` (per_node.py; the index lists the ranks it holds)."""
    return f"node{number:05d}.h5"


def master(bucket: int) -> str:
    """Bucket ``bucket``'s fp32 master shard (in a rank file, or a writer's part of shards.h5)."""
    return f"b{bucket}/master"


def state(bucket: int, key: str) -> str:
    """Bucket ``bucket``'s per-element optimizer state ``key`` (e.g. exp_avg)."""
    return f"b{bucket}/state/{key}"


def frozen(bucket: int) -> str:
    """Frozen bucket ``bucket``'s parameter shard (stage 3), in the compute dtype (frozen.py)."""
    return f"f{bucket}/param"
def node_dataset(rank: int, name: str) -> str:
    """Where writer ``rank``'s dataset ``name`` sits in a node file (per_node.py)."""
    return f"r{rank:05d}/{name}"


_NODE_DATASET = re.compile(r"^r([0-9]{5,})/(.+)$")


def node_part(path: str) -> tuple[int, str] | None:
    """(writer rank, dataset name) of a node file's dataset ``path``; None for any other path."""
    m = _NODE_DATASET.match(path.strip("/"))
    return (int(m.group(1)), m.group(2)) if m else None


def feedback(bucket: int) -> str:
    """This rank's error-feedback residual of bucket ``bucket`` (per-rank data, the bucket's padded size)."""
    return f"b{bucket}/feedback"


def replicated(name: str) -> str:
    """A frozen parameter or buffer, whole, in index.h5."""
    return f"replicated/{name}"


def shared_crc(name: str) -> str:
    """The (writers, blocks) checksum rows of dataset ``name`` in shards.h5."""
    return f"crc/{name}"


SHARED_CRC_PREFIX = shared_crc("")


def read_latest(root: Path) -> str | None:
    """The tag ``root/latest`` names, or None where ``root`` has no such pointer; CheckpointError where it
    is not a regular file inside ``root`` (a link out of it, a directory) or cannot be read. The one reader
    of the pointer: loads, ``zerompi ckpt inspect`` and retention."""
    pointer = root / LATEST
    if not pointer.exists() and not pointer.is_symlink():
        return None
    paths.regular_file(pointer, root, "checkpoint root")
    try:
        return pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer}: unreadable ({e})") from e


def check_tag(tag: str, source: str = "tag") -> str:
    """A tag is one plain path component: it can never point outside the checkpoint root."""
    if not isinstance(tag, str) or not _TAG.match(tag) or tag in (".", ".."):
        raise CheckpointError(f"{source} {tag!r} is not a valid checkpoint tag "
                              "(letters, digits, '.', '_', '-'; no path separators; not starting with '.')")
    return tag


def step_tag(step: int) -> str:
    """The tag a save takes by default after ``step`` optimizer steps (``step00000042``)."""
    return f"step{step:08d}"


INDEX_RANK = -1  # the "writer rank" index.h5's datasets are bound to


@dataclass(frozen=True)
class Binding:
    """What a dataset's checksums are bound to besides its bytes and datatype.

    From format version 2 each block's CRC-32 is seeded with the dataset's name (as this
    module spells it), the writing rank (``INDEX_RANK`` in index.h5), the save's id and
    the block's number, so that data moved to another tensor, rank, save or block no
    longer matches its checksums. Version-1 files seed with the datatype only.
    """

    name: str
    save_id: str
    rank: int
    version: int  # the file's format version (1: seeded with the datatype only)

    def seed(self, dtype: np.dtype, block: int) -> int:
        if self.version == 1:
            return zlib.crc32(dtype.str.encode())
        key = json.dumps([dtype.str, self.name, self.save_id, self.rank, block])
        return zlib.crc32(key.encode())


def bound_to(f: h5py.File, name: str) -> Binding:
    """The binding of dataset ``name`` of a file zerompi wrote, from its header (written first); in a
    node file, ``rNNNNN/NAME`` is writer NNNNN's NAME."""
    rank, version = objects.attr(f, "rank", "int"), objects.attr(f, "version", "int")
    name = name.strip("/")
    part = node_part(name) if objects.attr(f, "kind", "text") == text_attr("node") else None
    if part is not None:
        rank, name = part
    return Binding(name, save_id_of(f), INDEX_RANK if rank is None else int(rank),
                   VERSION if version is None else int(version))


def _crc(chunk: np.ndarray, dtype: np.dtype, binding: Binding, block: int) -> int:
    # Seeded with the datatype too, so a damaged datatype (byte order, signedness) fails the check
    # even though the bytes are intact: the same bytes would be read as other numbers.
    return crc32(np.ascontiguousarray(chunk).view(np.uint8), binding.seed(dtype, block))


def block_crc(chunk: np.ndarray, binding: Binding, block: int) -> int:
    """The checksum of block ``block`` of a dataset, from its elements ``chunk`` in memory."""
    return _crc(chunk, chunk.dtype, binding, block)


def blocks(n: int) -> int:
    """How many checksum blocks an ``n``-element array has (at least one)."""
    return max(1, -(-n // CRC_BLOCK))


def block_crcs(flat: np.ndarray, binding: Binding) -> np.ndarray:
    """CRC-32 of each ``CRC_BLOCK``-element block of a 1-D array."""
    out = np.empty(blocks(flat.shape[0]), dtype=np.uint32)
    for i in range(out.shape[0]):
        out[i] = _crc(flat[i * CRC_BLOCK:(i + 1) * CRC_BLOCK], flat.dtype, binding, i)
    return out


def write_array(group: h5py.Group, name: str, data: np.ndarray, binding: Binding | None = None) -> None:
    """Write a 1-D array with its block checksums (bound to the file's header unless ``binding``)."""
    flat = np.ascontiguousarray(data).reshape(-1)
    ds = group.create_dataset(name, data=flat)
    path = f"{group.name.strip('/')}/{name}".strip("/")
    ds.attrs["crc32"] = block_crcs(flat, binding or bound_to(group.file, path))


class Array:
    """A checked, checksummed 1-D run of elements: a dataset, or one writer's slice of a shared one."""

    def __init__(self, ds: h5py.Dataset, crcs: np.ndarray, binding: Binding, offset: int = 0,
                 length: int | None = None):
        self.ds, self.crcs, self.binding, self.offset = ds, crcs, binding, offset
        self.length = ds.shape[0] if length is None else length
        self.dtype = ds.dtype
        part = f" (rank {binding.rank}'s part)" if length is not None else ""
        self.where = f"{ds.file.filename}: {binding.name}{part}"


def open_array(f: h5py.File, name: str, binding: Binding, length: int = -1, dtype: str | None = None) -> Array:
    """Dataset ``name`` of ``f`` with its checksums, after the structural checks (objects.py) and,
    when given, the expected length and element type: nothing of its data is read yet."""
    ds = objects.dataset(f, name)
    objects.check_shape(ds, name, (length,), dtype)
    crcs = objects.attr(ds, "crc32", "<u4", (blocks(ds.shape[0]),))
    if crcs is None:
        raise CheckpointError(f"{f.filename}: {name}: no checksum attribute")
    return Array(ds, crcs, binding)


def read_array(arr: Array, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Read elements ``[start, stop)`` of ``arr``, verifying the checksum of every block it touches
    (a recovery point's array in memory, held.py, reads itself)."""
    if not isinstance(arr, Array):
        return arr.read(start, arr.length if stop is None else stop)
    n = arr.length
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise CheckpointError(f"{arr.where}: range [{start}, {stop}) outside [0, {n})")
    first, last = start // CRC_BLOCK, max(start, stop - 1) // CRC_BLOCK
    lo, hi = first * CRC_BLOCK, min(n, (last + 1) * CRC_BLOCK)
    try:
        data = arr.ds[arr.offset + lo:arr.offset + hi]
    except (OSError, RuntimeError) as e:  # truncated or damaged file
        raise CheckpointError(f"{arr.where}: unreadable ({e})") from e
    for b in range(first, last + 1 if hi > lo else first):
        chunk = data[(b - first) * CRC_BLOCK:(b - first + 1) * CRC_BLOCK]
        check_block(arr, chunk, b)
    return data[start - lo:stop - lo]


def check_block(arr: Array, chunk: np.ndarray, b: int) -> None:
    """Raise unless ``chunk`` (block ``b`` of ``arr``, read as the dataset's type) matches its checksum."""
    if b >= len(arr.crcs) or _crc(chunk, arr.dtype, arr.binding, b) != int(arr.crcs[b]):
        raise CheckpointError(f"{arr.where}: checksum mismatch in elements [{b * CRC_BLOCK}, "
                              f"{min(arr.length, (b + 1) * CRC_BLOCK)}): the file is corrupt, or this data belongs "
                              "to another tensor, rank or save")


def write_json(group: h5py.Group, name: str, obj) -> None:
    """JSON text as a string dataset (attributes are limited to 64 KiB), checksummed."""
    raw = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), dtype=np.uint8)
    write_array(group, name, raw)


def read_json(f: h5py.File, name: str, binding: Binding):
    raw = read_array(open_array(f, name, binding, dtype="u1"))
    try:
        return json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f.filename}: {name} is not valid JSON ({e})") from e


def open_h5(path: Path, mode: str = "r") -> h5py.File:
    """Open an HDF5 file, turning any failure into a CheckpointError naming it.

    For reading, the file must be a regular file inside its directory (paths.py), and every
    object in it is checked before the file is handed out (objects.check_file): a file holding a
    link, virtual dataset, external storage or filter anywhere is refused as a whole."""
    path = Path(path)
    try:
        if mode != "r":
            return h5py.File(path, mode)
        paths.regular_file(path)
        f = h5py.File(path, "r")
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: missing") from e
    except OSError as e:
        raise CheckpointError(f"{path}: not a readable HDF5 file ({e})") from e
    try:
        objects.check_file(f)
    except BaseException as e:
        f.close()
        if isinstance(e, H5_ERRORS) and not isinstance(e, CheckpointError):
            raise damaged(str(path), e) from e
        raise
    return f


def text_attr(value: str) -> np.bytes_:
    """A fixed-length string attribute: stored inline, never in HDF5's global heap, whose
    damaged object sizes can make HDF5 loop forever when the attribute is read."""
    return np.bytes_(value.encode())


def check_header(f: h5py.File, kind: str) -> int:
    """Check the header of a zerompi ``kind`` file; returns its format version."""
    if objects.attr(f, "format", "text") != text_attr(FORMAT) or objects.attr(f, "kind", "text") != text_attr(kind):
        raise CheckpointError(f"{f.filename}: not a zerompi {kind} file")
    version = objects.attr(f, "version", "int")
    if version is None or int(version) not in READS:
        raise CheckpointError(f"{f.filename}: format version {version}, this zerompi reads versions "
                              f"{', '.join(map(str, READS))}")
    return int(version)


def save_id_of(f: h5py.File) -> str:
    """The save's id in a file's header (checked to be a short fixed-length string)."""
    raw = objects.attr(f, "save_id", "text")
    return "" if raw is None else raw.decode(errors="replace")


def write_header(f: h5py.File, kind: str) -> None:
    f.attrs["format"] = text_attr(FORMAT)
    f.attrs["kind"] = text_attr(kind)
    f.attrs["version"] = VERSION


#: what h5py raises on a damaged file (besides our own CheckpointError, a RuntimeError)
H5_ERRORS = (OSError, RuntimeError, KeyError, TypeError, ValueError, IndexError, AttributeError)


def damaged(where: str, e: Exception) -> CheckpointError:
    """The CheckpointError for an h5py failure on a damaged file."""
    return CheckpointError(f"{where}: damaged or unreadable ({type(e).__name__}: {e})")
