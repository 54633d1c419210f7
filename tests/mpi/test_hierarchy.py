"""Node-aware groups on 4-8 real ranks, nodes emulated with ranks_per_node (workers/parity.py).

hsdp shards within a node and replicates across nodes; hpz adds a node-local
secondary parameter copy to stage 3. Both must match single-process training
within the bounds of tolerance.py (multiples of the order noise), send
exactly the bytes their algorithm implies on each group, and hold the memory
it implies. The subject here is the groups' communication, so each layout runs
matrix.PAIRWISE (every pair of option values once) rather than the flat
matrix's whole product, and the layouts cover 2 and 3 nodes, 2 and 3 ranks
per node, and even and uneven world sizes (an 8-rank hpz layout added nothing
to that and cost a fifth of the module).
"""
from __future__ import annotations

import numpy as np
import pytest

from .batch import Batch, run_planned
from .matrix import PAIRWISE, combos_arg, parity_results
from .tolerance import check_parity, check_resume

# (hierarchy, world size, ranks per node)
LAYOUTS = [("hsdp", 4, 2), ("hsdp", 6, 3), ("hpz", 4, 2), ("hpz", 6, 2)]
STAGES = {"hsdp": (1, 2, 3), "hpz": (3,)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = parity_results(tmp_path_factory)
    return lambda h, n, rpn: runs(n, "--hierarchy", h, "--ranks-per-node", str(rpn), "--combos", combos_arg(PAIRWISE))


CASES = [(h, n, rpn, stage, *combo) for h, n, rpn in LAYOUTS for stage in STAGES[h] for combo in PAIRWISE]


def _id(case):
    h, n, rpn, stage, dtype, accum, clip, opt = case
    return f"{h}-np{n}x{rpn}-stage{stage}-{dtype}-accum{accum}-{'clip' if clip else 'noclip'}-{opt}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_hierarchical_parity(results, case):
    h, n, rpn, *combo = case
    r = results(h, n, rpn)[tuple(combo)]
    check_parity(r)


def _expected(h, n, rpn, r):
    """Bytes per kind over the run, and model-state bytes, for hsdp and hpz."""
    s, nodes, steps, accum, p = rpn, n // rpn, r["steps"], r["accum"], r["padded"]
    c = 4 if r["dtype"] == "fp32" else 2
    k = (8 if r["optimizer"] == "adamw" else 4) + (0 if r["dtype"] == "fp32" else 4)
    intra = (s - 1) * p // s * c * steps              # one Ψ-sized collective inside a node, per step
    if h == "hpz":
        sent = {"all_gather@intra": 2 * accum * intra, "reduce_scatter": accum * (n - 1) * p // n * c * steps,
                "all_gather@inter": (nodes - 1) * (p // s) // nodes * c * steps}
        state = (c + c + k) * p // n + c * p // s      # flat stage 3 plus the secondary copy
        return sent, state
    inter = 2 * (nodes - 1) * (p // s) // nodes * 4 * steps  # shards all-reduced in fp32 across nodes
    stage = r["stage"]
    rs_per_step = 1 if stage == 1 else accum
    sent = {"reduce_scatter@intra": rs_per_step * intra, "all_reduce@inter": rs_per_step * inter,
            "all_gather@intra": (2 * accum if stage == 3 else 1) * intra}
    shard = p // s
    state = c * (p if stage < 3 else shard) + c * (p if stage < 2 else shard) + k * shard
    return sent, state


@pytest.mark.parametrize("h,n,rpn", LAYOUTS, ids=[f"{h}-np{n}x{rpn}" for h, n, rpn in LAYOUTS])
@pytest.mark.parametrize("dtype", ("fp32", "bf16"))
@pytest.mark.parametrize("accum", (1, 2))
def test_hierarchical_bytes_and_memory(results, h, n, rpn, dtype, accum):
    for stage in STAGES[h]:
        r = results(h, n, rpn)[(stage, dtype, accum, None, "adamw")]
        sent, state = _expected(h, n, rpn, r)
        got = {k: v for k, v in r["bytes_sent"].items() if k in sent}
        assert got == sent, (stage, r["bytes_sent"])
        assert not [k for k in r["bytes_sent"] if k.startswith("all_gather") and k not in sent]
        assert r["model_state_bytes"] == state, stage


def _moved(add, where, save, load):
    """ckpt.py saving under one layout, then resuming under another (after the save's job, or in it)."""
    def case(layout, mode, out, *extra, after=()):
        h, n, rpn = layout
        return add(n, "--mode", mode, "--root", where / "ckpt", "--out", where / out, "--stage", "3", "--hierarchy", h,
                   *(("--ranks-per-node", rpn) if rpn else ()), *extra, after=after)
    first = case(save, "save", "a.npz")
    case(load, "resume", "b.npz", "--model-seed", "9", "--orders", after=[first])


@pytest.fixture(scope="module")
def moved(request, tmp_path_factory):
    """Every selected checkpoint move, as few ckpt.py jobs as world sizes and dependencies allow
    (tests/mpi/batch.py): 3 instead of 6."""
    return run_planned(request, Batch("ckpt.py", tmp_path_factory), {"test_checkpoints_move_between_layouts": _moved})


# hpz -> hsdp at 4 ranks each: one world size, shards over 4 ranks saved, over 2 loaded
@pytest.mark.parametrize("save,load", [(("hsdp", 4, 2), ("flat", 3, None)), (("flat", 2, None), ("hpz", 4, 2)),
                                       (("hpz", 4, 2), ("hsdp", 4, 2))], ids=["hsdp-to-flat", "flat-to-hpz",
                                                                              "hpz-to-hsdp"])
def test_checkpoints_move_between_layouts(moved, request, save, load):
    tmp_path = moved(request)
    a, b = dict(np.load(tmp_path / "a.npz")), dict(np.load(tmp_path / "b.npz"))
    for key in (k for k in a if k.startswith("saved/")):
        assert np.array_equal(a[key], b[key]), key
    check_resume(a, b, "fp32")
