"""Loading reads only the checkpoint: checksums bound to tensor, rank and save; format versions;
paths that leave the checkpoint; attributes and files of the wrong kind (no MPI).

The hostile HDF5 structures themselves (links, virtual datasets, external storage, filters,
swapped data) are fuzzed in test_fuzz_checkpoint.py.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from zerompi.checkpoint import load_full_state_dict, schema, shared
from zerompi.checkpoint.cli import inspect
from zerompi.checkpoint.consolidate import consolidate
from zerompi.errors import CheckpointError
from tests.unit.engines import small_stage3_engine


def _trained_save(root: Path, tag: str = "t") -> dict[str, torch.Tensor]:
    engine = small_stage3_engine()
    engine.backward(engine(torch.randn(5, 4)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(root, tag=tag)
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return full


@pytest.fixture(autouse=True)
def _no_hang():
    faulthandler.dump_traceback_later(120, exit=True)  # a FIFO opened by mistake blocks forever
    yield
    faulthandler.cancel_dump_traceback_later()


# ---- checksums bound to what they cover -------------------------------------------------------------

def test_the_checksum_covers_name_rank_save_and_block():
    data = np.arange(10, dtype=np.float32)
    ref = schema.Binding("b0/master", "abc", 0, schema.VERSION)
    crc = schema.block_crcs(data, ref)
    for other in (ref.__class__("b0/state/exp_avg", "abc", 0, 2), ref.__class__("b0/master", "abd", 0, 2),
                  ref.__class__("b0/master", "abc", 1, 2)):
        assert schema.block_crcs(data, other)[0] != crc[0], other
    assert ref.seed(data.dtype, 0) != ref.seed(data.dtype, 1)  # a block moved within a dataset


def test_version_1_checkpoint_still_loads(tmp_path, monkeypatch):
    """A checkpoint written with format version 1 (CRC-32 seeded with the datatype only) loads."""
    monkeypatch.setattr(schema, "VERSION", 1)
    full = _trained_save(tmp_path / "ckpt")
    monkeypatch.undo()
    with h5py.File(tmp_path / "ckpt" / "t" / schema.rank_file(0)) as f:
        assert f.attrs["version"] == 1
        master = f[schema.master(0)]
        old = zlib.crc32(master[()].view(np.uint8), zlib.crc32(master.dtype.str.encode()))
        assert int(master.attrs["crc32"][0]) == old  # the old scheme, byte for byte
    with h5py.File(tmp_path / "ckpt" / "t" / schema.INDEX) as f:
        assert f.attrs["version"] == 1
    got = load_full_state_dict(tmp_path / "ckpt")
    assert all(torch.equal(got[k], full[k]) for k in full)
    got.close()
    engine = small_stage3_engine()
    engine.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(v, full[k]) for k, v in engine.full_state_dict().items())
    engine.close()


def test_new_checkpoints_have_the_bumped_version(tmp_path):
    _trained_save(tmp_path / "ckpt")
    with h5py.File(tmp_path / "ckpt" / "t" / schema.rank_file(0)) as f:
        assert f.attrs["version"] == schema.VERSION == 2


def _shared_file(directory: Path, world: int = 2, n: int = 6) -> list[np.ndarray]:
    """A shards.h5 as SharedWriter writes it, written here without MPI."""
    parts = [np.arange(n, dtype=np.float32) + 100 * r for r in range(world)]
    with h5py.File(directory / shared.SHARED, "w") as f:
        schema.write_header(f, shared.KIND)
        f.attrs["save_id"] = schema.text_attr("sid")
        f.attrs["world_size"] = world
        f.create_dataset("b0/master", data=np.concatenate(parts))
        f.create_dataset(schema.shared_crc("b0/master"), data=np.stack(
            [schema.block_crcs(p, schema.Binding("b0/master", "sid", r, schema.VERSION)) for r, p in enumerate(parts)]))
    return parts


def test_shared_file_rows_are_bound_to_their_rank(tmp_path):
    parts = _shared_file(tmp_path)
    files = shared.SharedFile(tmp_path, 2, "sid", schema.VERSION)
    for r in range(2):
        assert np.array_equal(schema.read_array(files.dataset(r, "b0/master", 6, "<f4")), parts[r])
    files.close()
    with h5py.File(tmp_path / shared.SHARED, "a") as f:  # ranks 0 and 1 trade data and checksum rows
        f["b0/master"][...] = np.concatenate(parts[::-1])
        crc = f[schema.shared_crc("b0/master")]
        crc[...] = crc[()][::-1]
    files = shared.SharedFile(tmp_path, 2, "sid", schema.VERSION)
    with pytest.raises(CheckpointError, match="rank 0's part.*checksum mismatch"):
        schema.read_array(files.dataset(0, "b0/master"))
    files.close()


def test_shared_file_declaring_more_than_the_index_says_is_refused_unread(tmp_path):
    _shared_file(tmp_path)
    files = shared.SharedFile(tmp_path, 2, "sid", schema.VERSION)
    with pytest.raises(CheckpointError, match=r"shape \(12,\), expected \(14,\)"):
        files.dataset(0, "b0/master", 7, "<f4")
    files.close()


# ---- paths that leave the checkpoint ------------------------------------------------------------------

def test_tag_directory_symlinked_outside_is_refused_everywhere(tmp_path):
    _trained_save(tmp_path / "elsewhere")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "t").symlink_to(tmp_path / "elsewhere" / "t")
    (root / schema.LATEST).write_text("t\n")
    engine = small_stage3_engine()
    for load in (lambda: engine.load_checkpoint(root), lambda: load_full_state_dict(root, "t"),
                 lambda: consolidate(root, tmp_path / "out.safetensors"),
                 lambda: inspect(argparse.Namespace(path=str(root), json=True, no_verify=False, tensors=False))):
        with pytest.raises(CheckpointError, match="is a symbolic link .* outside the checkpoint root"):
            load()
    engine.close()
    assert not (tmp_path / "out.safetensors").exists()


def test_symlink_to_another_tag_inside_the_root_loads(tmp_path):
    full = _trained_save(tmp_path / "ckpt", "a")
    (tmp_path / "ckpt" / "b").symlink_to("a")
    got = load_full_state_dict(tmp_path / "ckpt", "b")
    assert all(torch.equal(got[k], full[k]) for k in full)
    got.close()


@pytest.mark.parametrize("what", [schema.LATEST, schema.rank_file(0), schema.INDEX])
def test_a_fifo_in_place_of_a_file_is_refused_without_opening_it(tmp_path, what):
    root = tmp_path / "ckpt"
    _trained_save(root)
    path = root / what if what == schema.LATEST else root / "t" / what
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match="not a regular file"):
        dict(load_full_state_dict(root, None))  # rank files are checked as they are opened, before the open


# ---- attributes and datasets of the wrong kind ------------------------------------------------------

def test_header_attribute_of_another_type_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    _trained_save(root)
    with h5py.File(root / "t" / schema.rank_file(0), "a") as f:
        del f.attrs["rank"]
        f.attrs["rank"] = "0"  # a variable-length string (HDF5's global heap), not an integer
    with pytest.raises(CheckpointError, match="attribute 'rank' is"):
        dict(load_full_state_dict(root))


def test_checksum_attribute_of_another_shape_is_refused_unread(tmp_path):
    root = tmp_path / "ckpt"
    _trained_save(root)
    with h5py.File(root / "t" / schema.rank_file(0), "a") as f:
        f[schema.master(0)].attrs["crc32"] = np.zeros(1000, dtype=np.uint32)
    with pytest.raises(CheckpointError, match="attribute 'crc32'"):
        dict(load_full_state_dict(root))
