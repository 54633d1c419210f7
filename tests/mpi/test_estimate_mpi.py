"""zerompi.tools.estimate against the engine's own counters on 2, 3 and 4 real ranks (workers/estimate_check.py).

After one step, every rank's ``engine.stats.model_state_bytes`` must equal
the estimate at the padded parameter count (buckets are padded to a multiple
of the world size, and the engine keeps whole padded buffers), and exceed the
estimate at the true count by no more than the padding's own share. The bytes
one step sends must equal the estimate's communication volume.
"""
from __future__ import annotations

import pytest

from zerompi.tools.estimate import compute_bytes, optimizer_bytes

from .launcher import WorkerResults

WORLDS = (2, 3, 4)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return WorkerResults("estimate_check.py", lambda r: (r["stage"], r["dtype"], r["optimizer"]),
                         tmp_path_factory)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("stage", range(4), ids=lambda s: f"stage{s}")
@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("opt", ("adamw", "sgd"))
def test_model_state_bytes_match_estimate(rows, world, stage, dtype, opt):
    r = rows(world)[(stage, dtype, opt)]
    assert r["numel"] == r["model_numel"] and r["buckets"] > 1, r
    engine = r["model_state_bytes"]
    assert len(engine) == world and len(set(engine)) == 1, engine  # every rank holds the same amount
    assert engine[0] == r["estimate"]["padded"]["total"], r

    # At the true count the estimate is lower by at most the padding's bytes, never higher.
    pad = r["padded"] - r["numel"]
    assert 0 <= pad < world * r["buckets"], r
    per_element = 2 * compute_bytes(dtype) + optimizer_bytes(opt, dtype)
    assert 0 <= engine[0] - r["estimate"]["true"]["total"] <= per_element * pad, r


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("stage", range(4), ids=lambda s: f"stage{s}")
@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
def test_bytes_sent_match_estimate(rows, world, stage, dtype):
    r = rows(world)[(stage, dtype, "adamw")]
    assert r["bytes_sent"] == [r["estimate"]["padded"]["comm_bytes"]] * world, r


def test_padding_occurs(rows):
    # Otherwise "equal at the padded count" would not be distinguishable from "equal at the true count".
    assert any(r["padded"] > r["numel"] for world in (3, 4) for r in rows(world).values())
