"""Parity matrix: ZeRO stages 0-3 on 1-4 real MPI ranks against single-process PyTorch.

One ``mpiexec`` per world size runs every combination (workers/parity.py);
each combination is then judged here as its own test.

Bounds (tests/mpi/tolerance.py says why): every worker also trains the
single-process reference in three other summation orders; fp32 parameters
must stay, per tensor, within ORDER_K times the distance those reorderings
move them (floor: 2^-20 relative), 16-bit training within ORDER_K times their
distance relative to the size of the update. The bound follows this CPU's
rounding instead of a number fitted to one machine, and still fails a gradient
off by 1e-3, a sum instead of a mean, or a lost bucket (test_mutation.py).

* Communication per optimizer step equals the ZeRO paper's volumes exactly
  on the padded buffers: 2Ψ (stages 0-2) and 3Ψ (stage 3) times (N-1)/N.
* Model-state bytes equal the paper's formulas for the stage and dtype.
"""
from __future__ import annotations

import pytest

from .matrix import COMBOS, collective_bytes, combo_id, combos_arg, parity_results, zero_volume
from .tolerance import check_parity

WORLDS = (1, 2, 3, 4)
# One rank trains all four single-process references itself (at N ranks they are dealt over the ranks), so
# its job costs as much as the three others together: it runs the 8 combinations per stage that the byte
# tests below read, which still pair every dtype with accumulation 1/2, clipping on/off and both optimizers.
ONE_RANK = [(d, a, 0.05, "adamw") for d in ("fp32", "bf16") for a in (1, 2)] + \
           [(d, 1, None, o) for d in ("fp32", "bf16") for o in ("adamw", "sgd")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = parity_results(tmp_path_factory)
    return lambda world: runs(world, "--combos", combos_arg(ONE_RANK)) if world == 1 else runs(world)


def _cases():
    for world in WORLDS:
        for combo in COMBOS:
            if world > 1 or combo[1:] in ONE_RANK:
                yield pytest.param(world, combo, id=f"{combo_id(combo)}-np{world}")


@pytest.mark.parametrize("world,combo", list(_cases()))
def test_parity(results, world, combo):
    check_parity(results(world)[combo])


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("accum", (1, 2))
def test_bytes_match_zero_paper(results, world, stage, dtype, accum):
    r = results(world)[(stage, dtype, accum, 0.05, "adamw")]
    assert collective_bytes(r) == zero_volume(r), r["bytes_sent"]
    # Padding is at most one element per rank per bucket.
    assert 0 <= r["padded"] - r["numel"] < world * r["buckets"]
    # The clipping norm costs one scalar all-reduce per step, nothing more.
    assert r["bytes_sent"].get("control", 0) <= 16 * r["steps"]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("opt", ("adamw", "sgd"))
def test_model_state_bytes_match_zero_paper(results, world, stage, dtype, opt):
    r = results(world)[(stage, dtype, 1, None, opt)]
    p, shard = r["padded"], r["padded"] // world
    c = 4 if dtype == "fp32" else 2               # compute dtype bytes (params, grads)
    k = (8 if opt == "adamw" else 4) + (0 if dtype == "fp32" else 4)  # optimizer state + fp32 master
    params = c * (p if stage < 3 else shard)
    grads = c * (p if stage < 2 else shard)
    optim = k * (p if stage == 0 else shard)
    assert r["model_state_bytes"] == params + grads + optim
