"""The per-node layout on thread ranks: one file per (emulated) node, loadable at any world size.

4 ranks as 2 nodes of 2 (``ranks_per_node=2``) write ``node00000.h5`` and ``node00001.h5``;
the loaded state equals the per-rank layout's, bit for bit, at 4, 3 and 1 ranks; every
rank's part is bound to that rank, and a file the index does not describe is refused.
"""
from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import zerompi
from zerompi import ZeroConfig
from zerompi.checkpoint import schema
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.comm.local import run_ranks
from zerompi.errors import CheckpointError, UsageError


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


_TEMPLATE = _build()


def _model() -> torch.nn.Module:
    """A copy of one model built up front: thread ranks share torch's global generator, so building
    it in each rank's thread would race with the others' draws (and differ between runs)."""
    return copy.deepcopy(_TEMPLATE)


def _config(**kw) -> ZeroConfig:
    base = dict(stage=3, optimizer="adamw", lr=1e-2, seed=1, cpu_threads=1)
    return ZeroConfig(**{**base, **kw})


def _train(engine, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(7 + engine.group.rank)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()


def _state(engine) -> dict[str, bytes]:
    out = {n: t.numpy().tobytes() for n, t in engine.full_state_dict().items()}
    for i, st in enumerate(s for s in engine.optimizer.state.values() if s):
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() == 1:  # sharded per-element state: sizes differ per world size
                out[f"opt{i}/{k}/numel"] = str(v.numel()).encode()
    return out


def _save(root, layout: str, world: int = 4, **kw) -> list[dict[str, bytes]]:
    def rank(group):
        engine = zerompi.initialize(_model(), _config(checkpoint_layout=layout, ranks_per_node=2, **kw), group=group)
        try:
            _train(engine)
            engine.save_checkpoint(root, "t")
            return _state(engine)
        finally:
            engine.close()
    return run_ranks(world, rank, timeout=120)


def _load(root, world: int, stage: int = 3) -> list[dict[str, bytes]]:
    def rank(group):
        engine = zerompi.initialize(_model(), _config(stage=stage), group=group)
        try:
            engine.load_checkpoint(root, "t")
            params = {n: t.numpy().tobytes() for n, t in engine.full_state_dict().items()}
            _train(engine, 1)  # the loaded optimizer state steps on
            return params
        finally:
            engine.close()
    return run_ranks(world, rank, timeout=120)


def test_one_file_per_node_and_the_index_says_which_ranks(tmp_path):
    _save(tmp_path / "n", "per_node")
    files = sorted(p.name for p in (tmp_path / "n" / "t").iterdir())
    assert files == ["index.h5", "node00000.h5", "node00001.h5"]
    index = CheckpointIndex.read(tmp_path / "n" / "t" / schema.INDEX)
    assert index.layout == "per_node" and index.files == [[0, 1], [2, 3]]
    with h5py.File(tmp_path / "n" / "t" / "node00001.h5") as f:
        assert list(f.attrs["ranks"]) == [2, 3] and sorted(f) == ["r00002", "r00003"]


@pytest.mark.parametrize("world", [4, 3, 1])
def test_loads_as_the_per_rank_layout_does_at_any_world_size(tmp_path, world):
    saved = _save(tmp_path / "n", "per_node")
    _save(tmp_path / "r", "per_rank")
    by_node, by_rank = _load(tmp_path / "n", world), _load(tmp_path / "r", world)
    full = {k: v for k, v in saved[0].items() if "/" not in k or not k.startswith("opt")}
    for got in by_node:
        assert got == full  # bitwise: the saved fp32 masters, at another world size
    assert by_node == by_rank


def test_stage_one_hsdp_writes_one_file(tmp_path):
    """hsdp: only the first node's ranks write, so their one node writes one file."""
    _save(tmp_path / "h", "per_node", stage=1, hierarchy="hsdp")
    assert sorted(p.name for p in (tmp_path / "h" / "t").iterdir()) == ["index.h5", "node00000.h5"]
    assert CheckpointIndex.read(tmp_path / "h" / "t" / schema.INDEX).files == [[0, 1]]
    assert len({frozenset(s.items()) for s in _load(tmp_path / "h", 2, stage=1)}) == 1


def test_hpz_nodes_hold_their_ranks_in_the_shard_order(tmp_path):
    """hpz shards over every rank in the order local*nodes + node: node 0 holds shard ranks 0 and 2."""
    saved = _save(tmp_path / "z", "per_node", hierarchy="hpz")
    assert CheckpointIndex.read(tmp_path / "z" / "t" / schema.INDEX).files == [[0, 2], [1, 3]]
    for got in _load(tmp_path / "z", 2):
        assert got == {k: v for k, v in saved[0].items() if not k.startswith("opt")}


def test_a_part_moved_to_another_rank_does_not_verify(tmp_path):
    _save(tmp_path / "n", "per_node")
    path = tmp_path / "n" / "t" / "node00000.h5"
    with h5py.File(path, "r+") as f:  # swap ranks 0 and 1's masters, checksums and all
        a, b = f["r00000/b0/master"], f["r00001/b0/master"]
        ca, cb = a.attrs["crc32"].copy(), b.attrs["crc32"].copy()
        da, db = a[...].copy(), b[...].copy()
        a[...], b[...] = db, da
        a.attrs["crc32"], b.attrs["crc32"] = cb, ca
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        _load(tmp_path / "n", 2)


def test_a_file_holding_other_ranks_than_the_index_says_is_refused(tmp_path):
    _save(tmp_path / "n", "per_node")
    with h5py.File(tmp_path / "n" / "t" / "node00001.h5", "r+") as f:
        f.attrs["ranks"] = np.asarray([3, 2], dtype=np.int64)
    with pytest.raises(CheckpointError, match="holds ranks"):
        _load(tmp_path / "n", 4)


def test_async_save_refuses_the_per_node_layout(tmp_path):
    engine = zerompi.initialize(_model(), _config(checkpoint_layout="per_node"), comm=MPI.COMM_SELF)
    try:
        with pytest.raises(UsageError, match="per_node"):
            engine.save_checkpoint(tmp_path, "t", async_save=True)
    finally:
        engine.close()


def test_inspect_verifies_every_node_file(tmp_path):
    from zerompi.checkpoint.cli import _verify
    _save(tmp_path / "n", "per_node")
    directory = tmp_path / "n" / "t"
    index = CheckpointIndex.read(directory / schema.INDEX)
    assert _verify(directory, index).startswith("ok")
    with h5py.File(directory / "node00001.h5", "r+") as f:
        ds = f["r00003/b0/master"]
        ds[0] = ds[0] + 1.0
    assert "CORRUPT" in _verify(directory, index) and "rank 3" in _verify(directory, index)
