"""Non-blocking gradient reduce-scatter and stage-3 prefetch, progressed by MPI_Test or by the
communication thread (workers/parity.py --overlap test|thread).

Overlap changes when collectives run, never what they compute or how much they send:
the parity matrix must pass with the bounds of tolerance.py, and the bytes per
step must equal the blocking run's, for every stage and world size. Each stage
runs matrix.PAIRWISE (every pair of option values once): the options' interplay
is the flat matrix's subject, the timing of the collectives this one's.
"""
from __future__ import annotations

import pytest

from .matrix import PAIRWISE, collective_bytes, combo_id, combos_arg, parity_results, zero_volume
from .tolerance import check_parity

# (progress, world): MPI_Test at an even and an uneven world; the thread at the uneven one
RUNS = (("test", 2), ("test", 3), ("thread", 3))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = parity_results(tmp_path_factory)
    return lambda progress, world: runs(world, "--overlap", progress, "--combos", combos_arg(PAIRWISE))


@pytest.mark.parametrize("progress,world", RUNS, ids=lambda x: x if isinstance(x, str) else f"np{x}")
@pytest.mark.parametrize("combo", [(stage, *c) for stage in range(4) for c in PAIRWISE], ids=combo_id)
def test_overlapped_parity_and_bytes(results, progress, world, combo):
    r = results(progress, world)[combo]
    check_parity(r)
    assert collective_bytes(r) == zero_volume(r), r["bytes_sent"]
