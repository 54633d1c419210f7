"""Deferred initialisation: models built on the meta device (workers/meta.py).

No rank holds the whole model: each bucket's modules are materialised and
initialised when the bucket is built. The engine's initial values, given to an
eager single-process model, must train identically (fp32, SGD with momentum,
within the bounds of tolerance.py: the order of the gradient sums over ranks is
the only difference), at every stage; the values must follow the distributions
GPT.__init__ uses; a weight tied between two modules keeps the values its
first module gave it when the second one is materialised.
"""
from __future__ import annotations

import pytest

from .launcher import run_worker_json
from .tolerance import check_parity


@pytest.fixture(scope="module", params=(2, 3), ids=lambda n: f"np{n}")
def rows(request, tmp_path_factory):
    return run_worker_json(request.param, "meta.py", tmp_path_factory.mktemp("meta") / "rows.json")


def test_meta_models_train_like_eager_ones(rows):
    assert [(r["stage"], r["kind"]) for r in rows] == [(0, "gpt"), (1, "gpt"), (2, "gpt"), (3, "gpt"),
                                                        (1, "tied"), (3, "tied")]
    for r in rows:
        assert r["meta_left"] == [], r
        check_parity(r)
        # the only name the eager model has beyond named_parameters() is the tied alias
        assert r["not_loaded"] == (["lm_head.weight"] if r["kind"] == "gpt" else ["out.weight"]), r
    assert next(r for r in rows if r["stage"] == 3 and r["kind"] == "gpt")["units"] > 3


def test_meta_init_follows_the_gpt_distributions(rows):
    for r in (r for r in rows if r["kind"] == "gpt"):
        s = r["stats"]
        assert abs(s["embedding_std"] - 0.02) < 0.002 and abs(s["c_fc_std"] - 0.02) < 0.002, s
        assert abs(s["c_proj_std"] - s["c_proj_expected"]) < 0.1 * s["c_proj_expected"], s
        assert s["ln_weight_all_one"] and s["distinct_values"] == 3, s  # 3 layers, not one draw copied
