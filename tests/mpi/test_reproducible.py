"""reproducible=True on real ranks (workers/reproducible.py): one SHA-256 of the trained state at every
world size from 1 to G = 6, including the uneven 4 and 5 (ranks then run different numbers of
micro-batches), at stages 0-3, fp32 and bf16, offload none, cpu and nvme, with a frozen layer or LoRA (peft), dropout and
gradient clipping that bites: parameters, masters and optimizer state after every step; and a checkpoint
saved at one world size continues bitwise at another."""
from __future__ import annotations

import pytest

from .launcher import run_worker_json

WORLDS = (1, 2, 3, 4, 5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reproducible")
    return {n: run_worker_json(n, "reproducible.py", base / f"np{n}.json") for n in WORLDS}


def test_every_world_size_trains_the_same_bits(runs):
    rows = runs[1]["rows"]
    assert len(rows) == 20
    for key, ref in rows.items():
        assert ref["clipped"], key  # the clip coefficient is in play
        steps = {n: tuple(runs[n]["rows"][key]["steps"]) for n in WORLDS}
        assert len(set(steps.values())) == 1, (key, steps)
        assert [runs[n]["rows"][key]["norms"] for n in WORLDS] == [ref["norms"]] * len(WORLDS), key


def test_round_robin_indices(runs):
    assert runs[1]["rows"]["2-fp32-none-False"]["indices"] == [0, 1, 2, 3, 4, 5]
    assert runs[4]["rows"]["2-fp32-none-False"]["indices"] == [0, 4]  # rank 0 of 4: one more than ranks 2-3


@pytest.mark.parametrize("saved,loaded", [(4, 3), (3, 5)])
def test_resume_at_another_world_size_continues_bitwise(runs, saved, loaded, tmp_path):
    ckpt, rows = tmp_path / "ckpt", "3-fp32-none-False,2-bf16-cpu-True,0-fp32-none-True,3-bf16-nvme-True"
    run_worker_json(saved, "reproducible.py", tmp_path / "saved.json", "--save-after", "2", "--ckpt", str(ckpt),
                    "--rows", rows)
    resumed = run_worker_json(loaded, "reproducible.py", tmp_path / "resumed.json", "--resume", str(ckpt),
                              "--rows", rows)
    assert sorted(resumed["rows"]) == sorted(rows.split(","))
    for key, got in resumed["rows"].items():
        assert got["digest"] == runs[1]["rows"][key]["digest"], key
