"""Beyond 8 ranks: parity at 16, 32 and 64 ranks, 8 emulated nodes of 8, and checkpoints 64 -> 48, 17.

Opt-in (marker ``scale``): ``ZEROMPI_SCALE_TESTS=1 pytest -m scale tests/mpi/test_scale.py``.
The ranks oversubscribe the machine's cores (they yield while they wait: tools/mpirun.mpi_env) and
cost about 250 MB each, so 64 ranks need ~16 GB and one such job at a time. Bounds are the
parity matrix's (tolerance.py): fp32 SGD with momentum within ORDER_K times the summation-order
noise measured in the same run.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from .launcher import run_mpi
from .matrix import combos_arg, parity_results
from .tolerance import check_parity

pytestmark = [pytest.mark.scale,
              pytest.mark.skipif(os.environ.get("ZEROMPI_SCALE_TESTS") != "1",
                                 reason="64-rank jobs: opt in with ZEROMPI_SCALE_TESTS=1 (about 16 GB, one at a time)")]
TIMEOUT = 1800
SGD = combos_arg([("fp32", 1, None, "sgd")])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return parity_results(tmp_path_factory)


@pytest.mark.parametrize("world", (16, 32, 64), ids=lambda w: f"np{w}")
@pytest.mark.parametrize("stage", range(4))
def test_flat_parity(results, world, stage):
    rows = results(world, "--combos", SGD, "--threads", "1")
    check_parity(rows[(stage, "fp32", 1, None, "sgd")])


@pytest.mark.parametrize("hierarchy,stage", [("hsdp", 1), ("hsdp", 2), ("hsdp", 3), ("hpz", 3)])
def test_eight_nodes_of_eight(results, hierarchy, stage):
    rows = results(64, "--hierarchy", hierarchy, "--ranks-per-node", "8", "--combos", SGD, "--threads", "1")
    check_parity(rows[(stage, "fp32", 1, None, "sgd")])


@pytest.fixture(scope="module")
def saved_at_64(tmp_path_factory):
    where = tmp_path_factory.mktemp("scale_ckpt")
    run_mpi(64, "scale_ckpt.py", "--mode", "save", "--root", str(where), "--out", str(where / "saved.npz"),
            "--ranks-per-node", "8", timeout=TIMEOUT)
    return where


@pytest.mark.parametrize("world", (48, 17), ids=lambda w: f"np{w}")
def test_checkpoint_of_64_ranks_loads_bitwise(saved_at_64, world, tmp_path):
    out = tmp_path / "loaded.npz"
    run_mpi(world, "scale_ckpt.py", "--mode", "load", "--root", str(saved_at_64), "--out", str(out), timeout=TIMEOUT)
    saved, loaded = np.load(saved_at_64 / "saved.npz"), np.load(out)
    assert len(list((saved_at_64 / "per_node" / "t").glob("node*.h5"))) == 8
    assert len(list((saved_at_64 / "per_rank" / "t").glob("rank*.h5"))) == 64
    for key in saved.files:  # fp32 masters: the same bits whatever the world size and layout
        assert np.array_equal(saved[key], loaded[key]), key
    for layout in ("per_rank", "per_node"):
        assert int(loaded[f"{layout}/steps"]) == 3
