"""Stage 3 with param_persistence_threshold: small parameters stay gathered, the rest as before.

The fp32 and bf16 matrix of test_parity.py at stage 3 on 3 ranks, with a threshold that keeps
the tiny GPT's LayerNorm weights (16 elements) gathered: parity with single-process PyTorch by
the same order-noise bounds, and the communication is exactly what the split says: the sharded
part all-gathered in forward and backward (2Ψ_s per micro-batch) and reduce-scattered, the
persistent part reduce-scattered like the rest and all-gathered once per step after the update
(Ψ_p), instead of twice per micro-batch.
"""
from __future__ import annotations

import pytest

from .launcher import run_worker_json
from .matrix import COMBOS, collective_bytes, combo_id, combo_key
from .tolerance import check_parity

WORLD, THRESHOLD = 3, 17
STAGE3 = [c for c in COMBOS if c[0] == 3]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("persistence") / "rows.json"
    found = run_worker_json(WORLD, "parity.py", out, "--stages", "3", "--persistence", str(THRESHOLD))
    return {combo_key(r): r for r in found}


@pytest.mark.parametrize("combo", STAGE3, ids=combo_id)
def test_parity_with_persistent_small_parameters(rows, combo):
    r = rows[combo]
    assert 0 < r["persistent_padded"] < r["padded"]
    check_parity(r)


@pytest.mark.parametrize("combo", STAGE3, ids=combo_id)
def test_persistent_parameters_are_gathered_once_per_step(rows, combo):
    r = rows[combo]
    n, steps, accum = r["world"], r["steps"], r["accum"]
    itemsize = 4 if r["dtype"] == "fp32" else 2
    vol = lambda padded: (n - 1) * padded // n * itemsize * steps  # noqa: E731
    sharded, persistent = vol(r["padded"] - r["persistent_padded"]), vol(r["persistent_padded"])
    assert collective_bytes(r) == {"all_gather": 2 * accum * sharded + persistent,
                                   "reduce_scatter": accum * (sharded + persistent)}


def test_prefetch_under_max_live_params_keeps_parity_and_volume(tmp_path):
    """Prefetching two units ahead under a bound that admits only some of them: the same results
    (order-noise bounds) and the same bytes as gathering on demand."""
    out = tmp_path / "rows.json"
    rows = run_worker_json(2, "parity.py", out, "--stages", "3", "--quick", "--overlap", "test", "--max-live", "3000")
    for r in rows:
        check_parity(r)
        n, itemsize = r["world"], 4
        v = (n - 1) * r["padded"] // n * itemsize * r["steps"]
        assert collective_bytes(r) == {"all_gather": 2 * v, "reduce_scatter": v}
