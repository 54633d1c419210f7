"""Non-blocking gradient reduce-scatter, stage-3 prefetch and MPI_Test progress (workers/parity.py --overlap).

Overlap changes when collectives run, never what they compute or how much they send:
the parity matrix must pass with the tolerances of test_parity.py, and the bytes per
step must equal the blocking run's, for every stage and world size.
"""
from __future__ import annotations

import pytest

from .launcher import WorkerResults
from .test_parity import COMBOS, _id, _volume, check_parity

WORLDS = (2, 3)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = WorkerResults("parity.py", lambda r: (r["stage"], r["dtype"], r["accum"], r["clip"], r["optimizer"]),
                         tmp_path_factory)
    return lambda world: runs(world, "--overlap")


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_overlapped_parity_and_bytes(results, world, combo):
    r = results(world)[combo]
    check_parity(r)
    sent = {k: v for k, v in r["bytes_sent"].items() if k in ("all_reduce", "reduce_scatter", "all_gather")}
    assert sent == {k: v for k, v in _volume(r).items() if v or k in sent}, r["bytes_sent"]
