"""The parity bounds hold whatever the CPU's kernels and thread count (tolerance.py).

The fp32 rows of test_parity.py's matrix (accumulation, clipping, AdamW and SGD:
four rows that hold every pair of their values) for stages 0 and 3 at an uneven
world size, once with 2 torch threads per rank (the reductions
inside a GEMM split differently), once with ATen's scalar kernels and MKL held
to SSE4.2 (other vector widths round sums in other orders: what a CPU with or
without AVX-512 changes). Each run measures its own order noise, so the same
bound must hold in both.
"""
from __future__ import annotations

import pytest

from .launcher import run_worker_json
from .matrix import combo_id, combo_key, combos_arg
from .tolerance import check_parity

VARIANTS = {
    # passive OpenMP waits: 3 ranks x 2 threads on a 2-core machine would spin against each other
    # (3x the time); how a GEMM splits its sums depends on the thread count, not on how idle threads wait
    "threads2": (("--threads", "2"), {"OMP_WAIT_POLICY": "PASSIVE"}),
    "scalar-kernels": ((), {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}),
}
# what each variant's rows must show the ranks ran with (torch's threads, ATen's CPU capability); MKL's
# instruction set is not readable through torch (its MKL is linked in without MKL_Get_Version)
IN_EFFECT = {"threads2": {"threads": 2}, "scalar-kernels": {"cpu_capability": "DEFAULT"}}
STAGES = (0, 3)  # the all-reduce and the reduce-scatter path; the rest of the matrix costs time, not coverage
PAIRS = [("fp32", 1, None, "adamw"), ("fp32", 2, 0.05, "adamw"), ("fp32", 1, 0.05, "sgd"), ("fp32", 2, None, "sgd")]
FP32 = [(stage, *c) for stage in STAGES for c in PAIRS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = {}

    def run(variant):
        if variant not in cache:
            args, env = VARIANTS[variant]
            out = tmp_path_factory.mktemp(variant) / "rows.json"
            rows = run_worker_json(3, "parity.py", out, "--combos", combos_arg(PAIRS),
                                   "--stages", ",".join(map(str, STAGES)), *args, env=env)
            cache[variant] = {combo_key(r): r for r in rows}
        return cache[variant]
    return run


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("combo", FP32, ids=combo_id)
def test_parity_with_other_kernels_and_threads(results, variant, combo):
    row = results(variant)[combo]
    assert {k: row[k] for k in IN_EFFECT[variant]} == IN_EFFECT[variant], "the variant's setting did not take effect"
    check_parity(row)
