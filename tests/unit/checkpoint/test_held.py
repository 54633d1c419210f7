"""A recovery point held in memory (zerompi/checkpoint/held.py) against the per-rank files that a save of the
same step writes: the same datasets, the same refusals, the same data and buffers, and an exchange that
sends what the survivors ask for and nothing more."""
from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from torch import nn

import zerompi
from tests.unit.checkpoint.test_replica import CFG, _net, _train
from zerompi.checkpoint import reader, schema
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.comm.local import run_ranks
from zerompi.errors import CheckpointError
from zerompi.recovery.sources import MemoryPoints


def _saved_and_held(tmp_path, net: nn.Module, n: int = 4) -> list[MemoryPoints]:
    """``net`` trained 2 steps on ``n`` ranks, saved as per-rank files (``tmp_path/saved``) and taken as
    a memory point; each rank's points."""
    def rank(group):
        engine = zerompi.initialize(copy.deepcopy(net), CFG, group=group)
        _train(engine, 2)
        engine.save_checkpoint(tmp_path, tag="saved", include_frozen=False)
        points = MemoryPoints(tmp_path / "points")
        points.save(engine)
        engine.close()
        return points
    return run_ranks(n, rank)


def _outcome(fn, *args) -> tuple[str, object]:
    try:
        return "ok", fn(*args)
    except CheckpointError:
        return "refused", None


def test_a_held_point_answers_every_request_as_its_files_do(tmp_path):
    """Every old rank's datasets (and one no rank has), asked with each length (any, 0, its own, one more)
    and element type (any, its own, another), and read over ranges at and past their ends: the point held
    by two survivors of four refuses exactly what the same step's per-rank files refuse, says it has what
    they have, and serves what they hold; a range read but never asked for is refused by name."""
    points = _saved_and_held(tmp_path, _net())

    def survivor(group):  # ranks 2 and 3 lost: 0 and 1 hold their copies
        held = points[group.rank].restore(points[group.rank].newest(), group).held
        files = reader.open_shards(tmp_path / "saved", CheckpointIndex.read(tmp_path / "saved" / schema.INDEX))
        asking, whole = held.asking(), held.asking()
        names = sorted({n for _, n in held.toc} | {"nothing"})
        try:
            for r in range(4):
                for name in names:
                    assert asking.has(r, name) == files.has(r, name), (r, name)
                    if not files.has(r, name):
                        assert _outcome(asking.dataset, r, name)[0] == "refused"
                        continue
                    arr = files.dataset(r, name)
                    size, kind = arr.length, arr.dtype.str
                    other = "<f2" if kind != "<f2" else "<f4"
                    for length in (-1, 0, size, size + 1):
                        for dtype in (None, kind, other):
                            mine = _outcome(asking.dataset, r, name, length, dtype)[0]
                            assert mine == _outcome(files.dataset, r, name, length, dtype)[0], (r, name, length, dtype)
                    for a, b in ((0, 0), (0, size), (size, size), (1, 0), (-1, 1), (0, size + 1), (size, size + 1)):
                        mine = _outcome(asking.dataset(r, name).read, a, b)
                        theirs = _outcome(schema.read_array, arr, a, b)
                        assert mine[0] == theirs[0] and (mine[0] == "refused" or len(mine[1]) == len(theirs[1])), \
                            (r, name, a, b)
                    whole.dataset(r, name).read(0, size)
            served = held.serve(whole.asked)
            for r, name, _, size in whole.asked:
                assert np.array_equal(served.dataset(r, name).read(0, size),
                                      schema.read_array(files.dataset(r, name))), (r, name)
            r, name, _, size = next(a for a in whole.asked if a[3] > 1)
            with pytest.raises(CheckpointError, match=re.escape(f"{(r, name, 0, 1)} was read but not asked for")):
                served.dataset(r, name).read(0, 1)
        finally:
            files.close()
        return True
    assert run_ranks(2, survivor) == [True, True]


class _Normed(nn.Module):
    """A model with buffers that training changes (BatchNorm's running statistics)."""

    def __init__(self, features: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm, self.out = nn.Linear(6, features), nn.BatchNorm1d(features), nn.Linear(features, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def test_a_held_point_restores_buffers_as_its_files_do(tmp_path):
    """BatchNorm's running statistics come back from a memory point (held by two survivors of four) as the
    per-rank files of the same step restore them; a model with other buffers is refused by the point in
    the words the files use, naming the point where they name their directory."""
    net = _Normed()
    points = _saved_and_held(tmp_path, net)

    def survivor(group):
        point = points[group.rank].restore(points[group.rank].newest(), group)
        from_point, from_files = (zerompi.initialize(_Normed(), CFG, group=group) for _ in range(2))
        point.load(from_point)
        from_files.load_checkpoint(tmp_path, "saved")
        got = [dict(e.module.named_buffers()) for e in (from_point, from_files)]
        refused = []
        for load in (lambda e: point.load(e), lambda e: e.load_checkpoint(tmp_path, "saved")):
            other = zerompi.initialize(_Normed(), CFG, group=group)
            other.module.register_buffer("extra", torch.zeros(2))
            with pytest.raises(CheckpointError) as raised:
                load(other)
            refused.append(str(raised.value))
        return got, refused
    for (held, files), (by_point, by_files) in run_ranks(2, survivor):
        assert held.keys() == files.keys() and "norm.running_mean" in held
        assert all(torch.equal(held[k], files[k]) for k in held)
        assert not torch.equal(held["norm.running_mean"], torch.zeros(16))  # trained: not the initial zeros
        point = "<the recovery point of step 2 in memory>"
        assert f"{point}: checkpoint of a different model: buffers differ (extra)" in by_point
        assert by_point.replace(point, "WHERE") == by_files.replace(str(tmp_path / "saved"), "WHERE")


def test_the_exchange_sends_what_is_asked_and_nothing_more(tmp_path):
    """Survivor 0 asks for one whole dataset of old rank 1 (held by survivor 1), survivor 1 for nothing:
    survivor 1 sends exactly that dataset's bytes and survivor 0 sends none (the group's byte counters)."""
    points = _saved_and_held(tmp_path, _net())

    def survivor(group):
        held = points[group.rank].restore(points[group.rank].newest(), group).held
        name = next(n for r, n in sorted(held.toc) if r == 1 and n.endswith("master"))
        kind, size = held.toc[1, name]
        asked = [(1, name, 0, size)] if group.rank == 0 else []
        before = sum(v for k, v in group.bytes_sent.items() if k.startswith("recovery"))
        held.serve(asked)
        after = sum(v for k, v in group.bytes_sent.items() if k.startswith("recovery"))
        return after - before, size * np.dtype(kind).itemsize
    (sent0, asked0), (sent1, _) = run_ranks(2, survivor)
    assert (sent0, sent1) == (0, asked0) and asked0 > 0
