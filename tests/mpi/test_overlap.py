"""Non-blocking gradient reduce-scatter and stage-3 prefetch, progressed by MPI_Test or by the
communication thread (workers/parity.py --overlap test|thread).

Overlap changes when collectives run, never what they compute or how much they send:
the parity matrix must pass with the tolerances of test_parity.py, and the bytes per
step must equal the blocking run's, for every stage and world size.
"""
from __future__ import annotations

import pytest

from .launcher import WorkerResults
from .test_parity import COMBOS, _id, _volume, check_parity

# (progress, world): MPI_Test at an even and an uneven world; the thread at the uneven one
RUNS = (("test", 2), ("test", 3), ("thread", 3))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = WorkerResults("parity.py", lambda r: (r["stage"], r["dtype"], r["accum"], r["clip"], r["optimizer"]),
                         tmp_path_factory)
    return lambda progress, world: runs(world, "--overlap", progress)


@pytest.mark.parametrize("progress,world", RUNS, ids=lambda x: x if isinstance(x, str) else f"np{x}")
@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_overlapped_parity_and_bytes(results, progress, world, combo):
    r = results(progress, world)[combo]
    check_parity(r)
    sent = {k: v for k, v in r["bytes_sent"].items() if k in ("all_reduce", "reduce_scatter", "all_gather")}
    assert sent == {k: v for k, v in _volume(r).items() if v or k in sent}, r["bytes_sent"]
