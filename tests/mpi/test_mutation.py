"""The parity bounds catch a broken gradient reduction (workers/mutation.py).

The matrix of test_parity.py is rerun on 2 ranks (fp32, no accumulation, no
clipping) with the reduce-scatter's result changed on purpose. SGD is not
scale-invariant, so a gradient off by 1e-3 or summed instead of averaged must
fail every stage; a lost bucket must fail with AdamW too. (AdamW normalises the
gradient by its own running size, so it cannot see a uniform scale: that is why
the matrix keeps SGD.)
"""
from __future__ import annotations

import pytest

from .matrix import parity_results
from .tolerance import check_parity

EXPECT_FAIL = {"scale": ("sgd",), "sum": ("sgd",), "drop": ("sgd", "adamw")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = parity_results(tmp_path_factory)
    return lambda mutation: runs(2, "--quick", "--mutate", mutation)


def _passes(row) -> bool:
    try:
        check_parity(row)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("mutation", sorted(EXPECT_FAIL))
def test_broken_reduction_fails_parity(results, mutation):
    rows = results(mutation)
    assert {r["mutation"] for r in rows.values()} == {mutation}
    passed = sorted((stage, opt) for (stage, _, _, _, opt), r in rows.items()
                    if opt in EXPECT_FAIL[mutation] and _passes(r))
    assert not passed, f"'{mutation}' went unnoticed by (stage, optimizer): {passed}"
    assert {stage for stage, *_ in rows} == {0, 1, 2, 3}
