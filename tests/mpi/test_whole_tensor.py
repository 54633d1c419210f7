"""Muon + AdamW and Adafactor (whole tensors on owner ranks, zerompi/optim/whole.py) under real MPI at
2 and 3 ranks: with reproducible=True every trained tensor is bitwise the plain single-process loop's
(each torch optimizer on the model's own tensors), at stages 0-3; in the default mode each is within the
order noise, and a step sends no more bytes than AdamW's on the same model (the owner alignment's
padding never travels: MPI's counted collectives). The same cases run at 1-3 thread ranks in
tests/unit/optim/test_whole.py; here the collectives are MPI's."""
from __future__ import annotations

import hashlib

import pytest

from tests.unit.optim import test_whole as w

from .launcher import WorkerResults

CASES = [(mode, stage) for mode in w.MODES for stage in range(4)]
STEP_KINDS = ("all_gather", "reduce_scatter")


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


@pytest.fixture(scope="module")
def noise():
    """Each tensor's order noise: how far three other summation orders of the plain loop move it."""
    want = w._plain("muon+adamw", w.STEPS)
    scale = {k: float(v.abs().max()) for k, v in want.items()}
    out = {k: 0.0 for k in want}
    for chunks in ([list(range(w.G))[::-1]], [list(range(r, w.G, 2)) for r in range(2)],
                   [list(range(r, w.G, 3)) for r in range(3)]):
        alt = w._plain("muon+adamw", w.STEPS, chunks)
        out = {k: max(out[k], float((alt[k] - want[k]).abs().max()) / scale[k]) for k in want}
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_default_mode_is_within_the_order_noise_and_sends_adamw_s_bytes(results, noise, world, stage):
    from .tolerance import tensor_failures
    row = results(world)[("default", stage)]
    assert not tensor_failures(row["errors"], noise), tensor_failures(row["errors"], noise)
    # each rank's count differs (an owner sends what it owns); over the ranks, no more than AdamW's
    total = lambda rows: sum(v for r in rows for k, v in r.items() if k in STEP_KINDS)
    assert total(row["bytes_muon"]) <= total(row["bytes_adamw"]), (row["bytes_muon"], row["bytes_adamw"])


@pytest.mark.parametrize("world", [2, 3])
def test_counted_collectives_under_mpi(results, world):
    assert results(world)[("counted", None)]["failures"] == []
