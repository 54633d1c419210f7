"""Awkward models and misuse on 2 and 3 real ranks, at every stage (workers/edge.py).

Parity bounds are those of tolerance.py (multiples of the order noise measured
in the same run; fp16 judged on the whole update). Each case must also have
moved the parameters, so that "equal" cannot mean "untouched".
"""
from __future__ import annotations

import pytest

from .launcher import WorkerResults
from .tolerance import check_parity

WORLDS = (2, 3)
PARITY = ("unused", "frozen", "called_twice", "checkpointing", "param_groups", "custom_optimizer", "fp16")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return WorkerResults("edge.py", lambda r: (r["case"], r["stage"]), tmp_path_factory)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("stage", range(4), ids=lambda s: f"stage{s}")
@pytest.mark.parametrize("case", PARITY)
def test_edge_parity(rows, world, stage, case):
    r = rows(world)[(case, stage)]
    assert r["moved"] > 1e-2, r
    check_parity(r)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("stage", range(4), ids=lambda s: f"stage{s}")
def test_fp16_overflow_on_one_rank_skips_everywhere(rows, world, stage):
    r = rows(world)[("fp16_overflow", stage)]
    assert r["skipped"] == [1] * world and r["steps"] == [2] * world, r
    assert len(set(r["scales"])) == 1, r
    assert r["unchanged"] and r["changed_after"], r


EXPECTED = {"step_first": "UsageError: step() called before backward()",
            "backward_twice": "UsageError: backward() called 2 times without step()",
            "no_params": "ZeroMPIError: the model has no parameters",
            "bad_dtype": "ConfigError: dtype='fp8' is not one of",
            "mismatched": "ModelMismatchError: rank"}


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("stage", range(4), ids=lambda s: f"stage{s}")
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_misuse_raises_on_every_rank(rows, world, stage, case):
    errors = rows(world)[("misuse", stage)]["errors"][case]
    assert len(errors) == world
    for message in errors:
        assert message.startswith(EXPECTED[case]), errors
    if case == "mismatched":
        assert "fc2.weight" in errors[0] and "(5, 8)" in errors[0]
