"""Muon + AdamW and Adafactor (whole tensors on owner ranks, zerompi/optim/whole.py) under real MPI at
2 and 3 ranks: with reproducible=True every trained tensor is bitwise the plain single-process loop's
(each torch optimizer on the model's own tensors), at stages 0-3. The same cases run at 1-3 thread ranks
in tests/unit/optim/test_whole.py; here the collectives are MPI's."""
from __future__ import annotations

import hashlib

import pytest

from tests.unit.optim import test_whole as w

from .launcher import WorkerResults

CASES = [(mode, stage) for mode in w.MODES for stage in range(4)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return WorkerResults("whole_tensor.py", lambda r: (r["mode"], r["stage"]), tmp_path_factory)


@pytest.fixture(scope="module")
def plain():
    done = {}

    def get(mode):
        if mode not in done:
            done[mode] = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
                          for k, v in w._plain(mode, w.STEPS).items()}
        return done[mode]
    return get


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode,stage", CASES, ids=[f"{m}-stage{s}" for m, s in CASES])
def test_whole_tensor_optimizers_train_the_plain_loops_bits_under_mpi(results, plain, world, mode, stage):
    row = results(world)[(mode, stage)]
    assert row["world"] == world
    want = plain(mode)
    assert row["digests"].keys() == want.keys()
    assert not [k for k in want if row["digests"][k] != want[k]], "tensors off the plain loop's bits"
