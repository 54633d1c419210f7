"""recovery_source='memory': a rank's recovery point packed in memory, copied to its buddy, and loaded by
the survivors from the copies they hold, as a per-rank checkpoint's files would load, with nothing written
(checkpoint/replica.py, checkpoint/held.py, recovery/sources.py)."""
from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import zerompi
from zerompi.checkpoint import replica, schema
from zerompi.comm.local import run_ranks
from zerompi.errors import CheckpointError, ZeroMPIError
from zerompi.recovery.sources import MemoryPoints, coverage_problem


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    net[1].requires_grad_(False)  # frozen: left out of a point, restored from the model as initialize had it
    return net


CFG = zerompi.ZeroConfig(stage=3, dtype="bf16", optimizer="adamw", lr=1e-2, micro_batches=6, cpu_threads=1,
                         device="cpu", bucket_mb=120 * 4 / 2**20, checkpoint_layout="per_rank",
                         lr_schedule="warmup_cosine", warmup_steps=1, total_steps=10, abort_on_exception=False)


def _train(engine, steps: int) -> None:
    for step in range(steps):
        for i in engine.micro_batch_indices():
            g = torch.Generator().manual_seed(100 * step + i)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            engine.backward(((engine(x).float() - y) ** 2).mean())
        engine.step()


def _pointed(group, net: nn.Module, tmp_path, steps: int) -> tuple[zerompi.Engine, MemoryPoints]:
    """An engine of ``net`` trained ``steps`` steps over ``group``, and its memory points with one point taken."""
    engine = zerompi.initialize(copy.deepcopy(net), CFG, group=group)
    _train(engine, steps)
    points = MemoryPoints(tmp_path / "points")
    points.save(engine)
    return engine, points


def _datasets(path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def test_a_buddys_copy_holds_what_a_save_writes_and_loads_without_files(tmp_path):
    """Each rank's copy (its left neighbour's, half the job away) holds the datasets save_checkpoint writes
    for that rank; two survivors of four load the point from the copies they hold, writing nothing, to the
    state the job had, and to the state the saved checkpoint loads to at two ranks."""
    net, n = _net(), 4

    def rank(group):
        engine = zerompi.initialize(copy.deepcopy(net), CFG, group=group)
        _train(engine, 2)
        engine.save_checkpoint(tmp_path / "saved", tag="step00000002", include_frozen=False)
        points = MemoryPoints(tmp_path / "points")
        points.save(engine)
        got = replica.unpack(points.points[-1].held)
        assert (got.step, got.rank, got.world_size) == (2, (group.rank - 2) % n, n)
        return points, got.rank, dict(got.parts), engine.full_state_dict()
    ranks = run_ranks(n, rank)
    state = ranks[0][3]
    for _, r, parts, _ in ranks:
        saved = _datasets(tmp_path / "saved" / "step00000002" / schema.rank_file(r))
        assert saved.keys() == parts.keys() and all(np.array_equal(saved[k], parts[k].reshape(saved[k].shape))
                                                    for k in saved), r

    def load(group):
        point = ranks[group.rank][0].restore((2, 0), group)  # ranks 2 and 3 lost: 0 and 1 hold their copies
        engine = zerompi.initialize(_net(), CFG, group=group)
        point.load(engine)
        from_files = zerompi.initialize(_net(), CFG, group=group)
        from_files.load_checkpoint(tmp_path / "saved", "step00000002")
        return [(e.full_state_dict(), e.stats.steps, e.get_lr()) for e in (engine, from_files)]
    for (held, steps, lr), (files, file_steps, file_lr) in run_ranks(2, load):
        assert (steps, lr) == (file_steps, file_lr) and steps == 2
        assert all(torch.equal(held[k], state[k]) and torch.equal(files[k], state[k]) for k in state)
    assert not (tmp_path / "points").exists() or not any((tmp_path / "points").iterdir())


def test_a_damaged_replica_is_named():
    cut = torch.zeros(5, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="a recovery replica of 5 bytes cannot be read"):
        replica.unpack(cut)


def test_memory_points_name_a_rank_lost_with_its_buddy(tmp_path):
    """At 4 ranks ranks 1 and 3 hold each other's copies: losing both leaves nothing to recover them from."""
    net = _net()

    points = run_ranks(4, lambda group: _pointed(group, net, tmp_path, 0)[1])
    survivors = [points[0], points[2]]  # ranks 1 and 3 lost

    def restore(group):
        with pytest.raises(ZeroMPIError, match=r"rank\(s\) 1 \(whose copy rank 3 held\), 3 \(whose copy rank 1 held\) were lost together"):
            survivors[group.rank].restore(survivors[group.rank].newest(), group)
        return True
    assert run_ranks(2, restore) == [True, True]


@pytest.mark.parametrize("n,lost", [(3, 1), (3, 0), (5, 2), (5, 4), (6, 3)])
def test_memory_points_restore_a_lost_rank_at_uneven_world_sizes(tmp_path, n, lost):
    """Where the buddy is not the same both ways (N // 2 places on, N odd, or a rank not half the job
    from rank 0): the survivors offer every old rank's point, the lost one from its buddy's copy, and
    loading them gives the state the job had."""
    net = _net()

    def rank(group):
        engine, points = _pointed(group, net, tmp_path, 1)
        return points, engine.full_state_dict()
    ranks = run_ranks(n, rank)
    state, survivors = ranks[0][1], [p for r, (p, _) in enumerate(ranks) if r != lost]

    def restore(group):
        point = survivors[group.rank].restore(survivors[group.rank].newest(), group)
        engine = zerompi.initialize(_net(), CFG, group=group)
        point.load(engine)
        return engine.full_state_dict()
    for got in run_ranks(n - 1, restore):
        assert all(torch.equal(got[k], state[k]) for k in state)


def test_restored_files_must_cover_every_old_rank_once():
    assert coverage_problem(3, [[0], [2, 1]]) is None
    assert coverage_problem(3, [[0, 2], [2]]) == ("no survivor holds old rank(s) [1]; "
                                                  "old rank 2 is held by survivors [0, 1]")


def test_a_held_point_names_what_it_does_not_hold(tmp_path):
    """A read of a dataset no survivor's replica holds, or of another length or type than the replica's, is
    refused naming the point, the old rank and the dataset, before any exchange."""
    net = _net()

    def rank(group):
        _, points = _pointed(group, net, tmp_path, 1)
        held = points.restore(points.newest(), group).held
        files = held.asking()
        name = next(n for r, n in held.toc if r == 1 and n.endswith("master"))
        kind, size = held.toc[1, name]
        with pytest.raises(CheckpointError, match=r"step 1 in memory: old rank 1's nothing: not in any survivor"):
            files.dataset(1, "nothing")
        with pytest.raises(CheckpointError, match=rf"old rank 1's {name}: {size} x {kind}, expected {size + 1}"):
            files.dataset(1, name, size + 1)
        with pytest.raises(CheckpointError, match="expected"):
            files.dataset(1, name, size, "<f2")
        assert files.dataset(1, name, size, kind).read(0, 2).tolist() == [0.0, 0.0]  # asking: zeros, recorded
        assert files.asked == [(1, name, 0, 2)]
        return True
    assert run_ranks(2, rank) == [True, True]
