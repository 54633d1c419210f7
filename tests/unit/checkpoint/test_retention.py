"""Keeping the last K checkpoints (checkpoint/retention.py), and a failed load that names the others.

Real checkpoints of a small engine (two ranks as threads, real HDF5 files) at steps 1-4. ``prune`` removes
all but the K newest complete tags, never the one ``latest`` names, a save in flight, a copy a killed
replacement left aside, or a tag whose index does not read. A load of a damaged ``latest`` fails naming
the other complete tags and how to load one.

Breaks: order tags by name instead of steps (the test names tags against their order), or remove what
does not read, and a test fails."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import zerompi
from zerompi.checkpoint import retention
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig
from zerompi.errors import CheckpointError

# tag names that sort against their steps: the steps, not the names, decide the age
TAGS = {1: "d-first", 2: "c-second", 3: "b-third", 4: "a-fourth"}


def _save_four(root):
    def rank(group):
        torch.manual_seed(0)
        engine = zerompi.initialize(nn.Linear(4, 2), ZeroConfig(stage=1), group=group)
        for step in range(1, 5):
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
            engine.save_checkpoint(root, tag=TAGS[step])
        engine.close()
    run_ranks(2, rank)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("four")
    _save_four(root)
    return root


def _copy(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root, symlinks=True)
    return root


def test_complete_tags_are_newest_first_by_their_steps(saved, tmp_path):
    assert retention.complete_tags(saved) == [retention.Tag(TAGS[s], s) for s in (4, 3, 2, 1)]
    assert retention.complete_tags(str(saved)) == retention.complete_tags(saved)  # a str root too
    assert retention.complete_tags(saved / "nowhere") == []
    root = _copy(saved, tmp_path)
    shutil.copytree(root / TAGS[1], root / f".old-{TAGS[1]}-0")  # a killed replacement's copy: whole, hidden
    assert retention.complete_tags(root) == retention.complete_tags(saved)


def test_prune_keeps_the_k_newest_and_latests_and_touches_nothing_else(saved, tmp_path):
    root = _copy(saved, tmp_path)
    (root / ".tmp-a-fifth-0").mkdir()  # a save in flight
    (root / "notes").mkdir()  # no index: not a checkpoint, not ours to remove
    (root / "e-broken").mkdir()
    (root / "e-broken" / "index.h5").write_bytes(b"not hdf5")  # unreadable: never removed unread
    shutil.copytree(root / TAGS[1], root / f".old-{TAGS[1]}-0")  # complete, but a replacement's copy
    assert retention.prune(str(root), 2) == [TAGS[2], TAGS[1]]
    assert sorted(p.name for p in root.iterdir()) == sorted([".tmp-a-fifth-0", "notes", "e-broken", "latest",
                                                             f".old-{TAGS[1]}-0", TAGS[4], TAGS[3]])
    (root / "latest").write_text(TAGS[3])  # latest names an older tag (a user moved it): it stays
    assert retention.prune(root, 1) == [] and (root / TAGS[3]).is_dir() and (root / TAGS[4]).is_dir()
    with pytest.raises(ValueError, match="at least 1"):
        retention.prune(root, 0)


def test_a_damaged_latest_is_named_with_the_other_checkpoints_and_how_to_load_one(saved, tmp_path):
    root = _copy(saved, tmp_path)
    index = root / TAGS[4] / "index.h5"
    index.write_bytes(index.read_bytes()[:200])  # truncated: latest's index is damaged

    def rank(group):
        engine = zerompi.initialize(nn.Linear(4, 2), ZeroConfig(stage=1), group=group)
        try:
            with pytest.raises(CheckpointError) as failed:
                engine.load_checkpoint(root)
            engine.load_checkpoint(root, tag=TAGS[3])  # the hint's way works
            return str(failed.value)
        finally:
            engine.close()
    for message in run_ranks(2, rank):
        assert f"other checkpoints under {root}: {TAGS[3]} (step 3), {TAGS[2]} (step 2), {TAGS[1]} (step 1)" \
            in message, message
        assert "load_checkpoint(path, tag=TAG)" in message, message


def test_the_hint_names_the_three_newest_others_or_nothing(saved, tmp_path):
    """Without a tag the failed one is latest's; at most three others, newest first; none: no hint."""
    root = _copy(saved, tmp_path)
    shutil.copytree(root / TAGS[1], root / "z-copy")  # step 1 too: after the step-2 tag, before d-first
    hint = retention.others_hint(str(root), None)
    assert hint == (f"; other checkpoints under {root}: {TAGS[3]} (step 3), {TAGS[2]} (step 2), z-copy (step 1): "
                    "load one with load_checkpoint(path, tag=TAG)")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copytree(root / TAGS[4], alone / TAGS[4])
    assert retention.others_hint(alone, TAGS[4]) == ""
