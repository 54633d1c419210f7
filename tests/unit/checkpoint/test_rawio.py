"""Checkpoint files written and read at the speed of the disk (zerompi/checkpoint/rawio.py): plain HDF5,
checksums computed once from memory, datasets aligned, reads straight into the caller's array."""
from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from zerompi.checkpoint import schema
from zerompi.checkpoint.durable import verify_file
from zerompi.checkpoint.per_rank import RankFiles, write_rank_file
from zerompi.checkpoint.rawio import SMALL, WriteOptions, read_into
from zerompi.errors import CheckpointError
from tests.components import unavailable

N = 3 * schema.CRC_BLOCK + 12345  # four checksum blocks, the last one partial


def _parts():
    g = np.random.default_rng(0)
    return [("b0/master", g.standard_normal(N).astype("<f4")), ("b0/state/exp_avg", g.standard_normal(N).astype("<f4")),
            ("b1/master", np.arange(100, dtype="<f4")), ("rng/torch_cpu", g.integers(0, 255, 5056).astype("u1"))]


@pytest.fixture(params=[(4096, False), (1 << 20, True)], ids=["align4k", "align1m-verify"])
def written(tmp_path, request):
    align, verify = request.param
    path = tmp_path / schema.rank_file(0)
    write_rank_file(path, 0, 1, iter(_parts()), "save1", WriteOptions(align=align, verify=verify))
    return path, align


def test_rank_file_is_plain_checksummed_hdf5_with_aligned_large_datasets(written):
    path, align = written
    verify_file(path)  # every checksum, as bound to the header, over HDF5's own reads
    with h5py.File(path, "r") as f:
        for name, data in _parts():
            assert np.array_equal(f[name][()], data), name
            if data.nbytes >= SMALL:
                assert f[name].id.get_offset() % align == 0, name
        assert f["b0/master"].attrs["crc32"].shape == (4,)


@pytest.mark.parametrize("start,stop", [(0, N), (5, N - 7), (schema.CRC_BLOCK, 2 * schema.CRC_BLOCK), (N - 1, N)])
def test_read_into_reads_any_range_checked(written, start, stop):
    path, _ = written
    files = RankFiles(path.parent, 1, "save1", schema.VERSION)
    try:
        arr = files.dataset(0, "b0/master", N, "<f4")
        out = np.full(stop - start, np.nan, dtype="<f4")
        read_into(arr, start, stop, out)
        assert np.array_equal(out, _parts()[0][1][start:stop])
    finally:
        files.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_read_into_names_a_damaged_block(written, damage):
    """A flipped bit fails its block's checksum; a file cut short under an open reader is a short read."""
    path, _ = written
    with h5py.File(path, "r") as f:
        offset = f["b0/master"].id.get_offset()
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[offset + 4 * (2 * schema.CRC_BLOCK + 7)] ^= 0x01  # in block 2
        path.write_bytes(bytes(raw))
    files = RankFiles(path.parent, 1, "save1", schema.VERSION)
    try:
        arr = files.dataset(0, "b0/master", N, "<f4")
        if damage == "truncate":
            os.truncate(path, offset + 4 * (2 * schema.CRC_BLOCK))
        with pytest.raises(CheckpointError) as err:
            read_into(arr, 0, N, np.empty(N, dtype="<f4"))
    finally:
        files.close()
    assert "b0/master" in str(err.value)
    expect = "checksum mismatch in elements" if damage == "flip" else "truncated"
    assert expect in str(err.value) and f"[{2 * schema.CRC_BLOCK}, {3 * schema.CRC_BLOCK})" in str(err.value)


def test_a_failed_write_leaves_no_half_checked_file_behind_the_error(tmp_path):
    def parts():
        yield "b0/master", np.ones(N, dtype="<f4")
        raise OSError(28, "No space left on device (test)")
    with pytest.raises(OSError):
        write_rank_file(tmp_path / "rank00000.h5", 0, 1, parts(), "s", WriteOptions())


# -- direct I/O ----------------------------------------------------------------------

def _written_with(path, options, parts):
    from zerompi.checkpoint.rawio import DataFile
    out = DataFile(path, options)
    schema.write_header(out.h5, "rank")
    for name, data in parts:
        out.put(name, data)
    direct = out.direct_bytes
    out.close()
    return direct


def _contents(path) -> dict:
    with h5py.File(path, "r") as f:
        return {name: (f[name][()], f[name].attrs["crc32"].tolist()) for name in ("b0/master", "b0/state/exp_avg")}


@pytest.mark.parametrize("align", [4096, 1], ids=["aligned", "unaligned-offsets"])
def test_direct_writes_give_the_buffered_file_contents(tmp_path, align):
    """Whole pages go through O_DIRECT (from staging buffers: numpy's memory is not page aligned),
    ragged tails through the page cache; datasets, checksums and a verifying re-read are those of
    buffered writes. Datasets whose offset is not page aligned are written buffered throughout."""
    from zerompi.blockio.aligned import ALIGN
    parts = _parts()[:2]
    direct = _written_with(tmp_path / "direct.h5", WriteOptions(align=align, direct=True), parts)
    buffered = _written_with(tmp_path / "buffered.h5", WriteOptions(align=align, direct=False), parts)
    assert buffered == 0
    if align >= ALIGN:
        assert direct == 2 * (N * 4 // ALIGN * ALIGN)  # whole blocks are whole pages; the last one's tail is not
    assert direct % ALIGN == 0
    ours, theirs = _contents(tmp_path / "direct.h5"), _contents(tmp_path / "buffered.h5")
    for name, (data, crcs) in ours.items():
        assert np.array_equal(data, theirs[name][0]) and crcs == theirs[name][1], name
        assert np.array_equal(data, dict(parts)[name]), name
    verify_file(tmp_path / "direct.h5")


def test_page_aligned_memory_is_written_without_staging(tmp_path):
    """Data already on a 4 KiB boundary (NVMe-offload shards) goes straight to the file."""
    import torch

    from zerompi.blockio.aligned import aligned_empty
    data = aligned_empty(N, torch.float32)
    data.copy_(torch.from_numpy(_parts()[0][1]))
    arr = data.numpy()
    assert arr.ctypes.data % 4096 == 0
    direct = _written_with(tmp_path / "a.h5", WriteOptions(align=4096), [("b0/master", arr)])
    assert direct > 0
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert np.array_equal(f["b0/master"][()], arr)
    verify_file(tmp_path / "a.h5")


def test_a_filesystem_refusing_o_direct_gets_buffered_writes(tmp_path):
    """ramfs refuses O_DIRECT at open(); mounted in a private mount namespace of a child."""
    import shutil
    import subprocess
    import sys
    import textwrap
    if os.geteuid() != 0 or not shutil.which("unshare"):
        unavailable("ramfs", "mounting one (a filesystem that refuses O_DIRECT) needs root and unshare(1)")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import numpy as np
        from zerompi.checkpoint.durable import verify_file
        from zerompi.checkpoint.per_rank import write_rank_file
        from zerompi.checkpoint.rawio import WriteOptions
        data = np.arange({N}, dtype="<f4")
        write_rank_file("{mnt}/r.h5", 0, 1, [("b0/master", data)], "s", WriteOptions(align=4096, verify=True))
        verify_file("{mnt}/r.h5")
        print("ok")
    """))
    root = str(Path(__file__).resolve().parents[3])
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t ramfs none {mnt} && exec {sys.executable} {script}"],
                          env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True, timeout=60)
    if "mount" in proc.stderr and proc.returncode != 0:
        unavailable("ramfs", f"mount failed: {proc.stderr.strip()}")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_failed_reads_have_all_ended_when_the_error_is_raised():
    """A load closes its files once the reads fail: no read may still be running then."""
    import threading
    import time

    from zerompi.checkpoint.rawio import Reads
    ended, lock = [], threading.Lock()

    def task(i):
        def run():
            time.sleep(0.05 * (i % 3))
            with lock:
                ended.append(i)
            if i == 1:
                raise CheckpointError("block 1: checksum mismatch (test)")
        return run
    reads = Reads(threads=4)
    reads.add([task(i) for i in range(6)])
    reads.add([task(i) for i in range(6, 12)])
    with pytest.raises(CheckpointError, match="block 1"):
        reads.wait()
    assert sorted(ended) == list(range(12))
