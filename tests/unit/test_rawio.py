"""Checkpoint files written and read at the speed of the disk (zerompi/checkpoint/rawio.py): plain HDF5,
checksums computed once from memory, datasets aligned, reads straight into the caller's array."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from zerompi.checkpoint import schema
from zerompi.checkpoint.durable import verify_file
from zerompi.checkpoint.per_rank import RankFiles, write_rank_file
from zerompi.checkpoint.rawio import SMALL, WriteOptions, read_into
from zerompi.errors import CheckpointError

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
