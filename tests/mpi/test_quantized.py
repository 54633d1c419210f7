"""Quantized collectives (ZeRO++ qwZ / qgZ) on 2, 3 and 4 real ranks: workers/quantized.py's rows.

* Collectives alone: every reduce-scatter and all-gather result lies within the bound derived
  from the block scales every rank used (half a step per value, summed over the ranks, plus the
  fp32 rounding of the sum) of the exact float64 result, for random values and for all-zero,
  constant, huge and subnormal blocks; the bytes counted are exactly the packed chunks (codes +
  fp32 scales); non-blocking equals blocking; error feedback sends x + old residual - new residual;
  a NaN/Inf block makes exactly its block non-finite on the rank that owns it.
* Through the engine (tiny GPT): bytes per collective kind are exactly the formula over the
  buckets' shard sizes (stages 1-3, accumulation, hpZ, HSDP, persistent parameters); the gathered
  parameters lie within the owners' scales' bound of the exact (master) values and are bitwise the
  same on every rank; offload (cpu, nvme) and overlap/prefetch give bitwise the blocking result;
  the state bytes quantisation adds are exactly its codes, residuals and (stages 1-2) the separate
  master; a checkpoint resume is bitwise, another world size drops the residuals; NaN gradients
  raise naming rank and parameter, or skip (fp16 too) leaving finite residuals.

Quantization off runs the code of before: ``tests/fingerprint.py --check`` found every digest of
the parity matrix (stages 0-3, 1-4 ranks, overlap, hsdp, hpz) bitwise unchanged by this feature.
"""
from __future__ import annotations

import math

import pytest

from .launcher import WorkerResults

ARGS = {2: ("--rows", "all"), 3: ("--rows", "core"), 4: ("--rows", "hpz")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return WorkerResults("quantized.py", lambda r: r["case"], tmp_path_factory)


def packed(n: int, bits: int, block: int) -> int:
    """One rank's packed chunk of n values, by hand: an fp32 scale per block, then the codes."""
    return 4 * math.ceil(n / block) + (n if bits == 8 else math.ceil(n / 2))


def rows_of(results, world: int, prefix: str) -> list[dict]:
    return [r for case, r in results(world, *ARGS[world]).items() if case.startswith(prefix)]


# ---- the collectives alone ----------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_within_the_scales_bound_and_bytes_exact(results, world):
    found = rows_of(results, world, "rs/int")
    assert len(found) == 12
    for r in found:
        assert r["finite"] and r["async_equal"], r["case"]
        assert r["max_ratio"] <= 1.0, r["case"]
        assert r["sent"] == {f"reduce_scatter.int{r['bits']}": (world - 1) * packed(r["chunk"], r["bits"], r["block"])}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_gather_within_the_scales_bound_same_on_every_rank(results, world):
    found = rows_of(results, world, "ag/")
    assert len(found) == 4
    for r in found:
        assert r["finite"] and r["async_equal"] and r["replicas_equal"], r["case"]
        assert r["max_ratio"] <= 1.0, r["case"]
        assert r["sent"] == {"all_gather.int8": (world - 1) * packed(r["chunk"], 8, 256)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_error_feedback_sends_what_it_carries(results, world):
    r = results(world, *ARGS[world])["rs/feedback"]
    assert r["identity_ratio"] <= 1.0 and r["residual_nonzero"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nonfinite_block_is_reported_in_its_block_only(results, world):
    r = results(world, *ARGS[world])["rs/nan"]
    assert r["nonfinite"][0] == list(range(2 * r["block"]))  # the Inf's block 0 and the NaN's block 1
    assert all(not idx for idx in r["nonfinite"][1:])


# ---- through the engine ---------------------------------------------------------------------------

def expected_bytes(r: dict) -> dict[str, int]:
    """Bytes per kind over the run, from the buckets' shard sizes."""
    n, steps, accum = r["world"], r["steps"], r["accum"]
    c = 4 if "bf16" not in r["case"] else 2
    wq, gq = r["quantize_weights"], r["quantize_grads"]
    gbits = {"int8": 8, "int4": 4}.get(gq)
    hier, per_node = r["hierarchy"], r["ranks_per_node"]
    nodes = n // per_node if per_node else 1
    out: dict[str, int] = {}

    def add(kind: str, nbytes: int) -> None:
        if nbytes:
            out[kind] = out.get(kind, 0) + nbytes

    for b in r["buckets"]:
        s = b["shard"]
        w_chunk = packed(s, 8, r["block"]) if wq == "int8" else s * c
        g_chunk = packed(s, gbits, r["block"]) if gbits else s * c
        ag = "all_gather.int8" if wq == "int8" else "all_gather"
        rs = f"reduce_scatter.{gq}" if gbits else "reduce_scatter"
        reductions = steps * (accum if r["stage"] >= 2 else 1)
        if hier == "hpz" and b["sharded"]:
            add(f"{ag}@intra", 2 * accum * steps * (per_node - 1) * nodes * w_chunk)
            add(f"{ag}@inter", steps * (nodes - 1) * w_chunk)
            add(rs, reductions * (n - 1) * g_chunk)
        elif hier == "hsdp":
            add(f"{ag}@intra", (2 * accum if b["sharded"] else 1) * steps * (per_node - 1) * w_chunk)
            add(f"{rs}@intra", reductions * (per_node - 1) * g_chunk)
            add("all_reduce@inter", reductions * 2 * (nodes - 1) * s * 4 // nodes)
        else:
            add(ag, (2 * accum if b["sharded"] else 1) * steps * (n - 1) * w_chunk)
            add(rs, reductions * (n - 1) * g_chunk)
    return out


def sent(r: dict) -> dict[str, int]:
    keep = ("all_gather", "reduce_scatter", "all_reduce")
    return {k: v for k, v in r["bytes_sent"].items() if v and k.split(".")[0].split("@")[0] in keep}


ENGINE_CASES = [(2, c) for c in ("s1-w8g8", "s1-w8g4ef", "s2-w8g8", "s2-w8g4ef", "s3-w8g8", "s3-w8g4ef", "s3-w8",
                                 "s3-g4", "s3-w8g8-bf16-accum2", "s2-w8g8-bf16-accum2", "s3-w8g4ef-persist",
                                 "s3-w8g4ef-overlap", "s3-w8g4ef-thread", "s3-w8g4ef-cpu", "s3-w8g4ef-nvme",
                                 "s2-w8g4ef-nvme",
                                 "s2-w8g4ef-overlap", "s3-w8g4ef-hpz1")]
ENGINE_CASES += [(3, c) for c in ("s1-w8g8", "s1-w8g4ef", "s2-w8g8", "s2-w8g4ef", "s3-w8g8", "s3-w8g4ef",
                                  "s3-w8g8-bf16-accum2", "s3-w8g4ef-hpz1")]
ENGINE_CASES += [(4, c) for c in ("s3-w8g4ef-hpz", "s3-w8g4ef-hpz-overlap", "s3-w8g8-hsdp", "s2-w8g8-hsdp")]


@pytest.mark.parametrize("world,case", ENGINE_CASES, ids=[f"np{w}-{c}" for w, c in ENGINE_CASES])
def test_engine_bytes_bound_and_replicas(results, world, case):
    r = results(world, *ARGS[world])[f"train/{case}"]
    assert sent(r) == expected_bytes(r)
    if r["quantize_weights"] == "int8":
        assert r["gather_ratio"] <= 1.0  # every decoded parameter within its owner's block bound
    assert r["replicas_equal"]
    assert all(math.isfinite(x) for x in r["losses"])


def quantization_state_bytes(r: dict) -> int:
    """What quantisation adds to model_state_bytes: packed weight shards (hpZ: the packed node copy instead
    of the plain one), error-feedback residuals, and at stages 1-2 (fp32) a master apart from the decoded
    parameters."""
    extra, nodes = 0, r["world"] // (r["ranks_per_node"] or r["world"])
    for b in r["buckets"]:
        s = b["shard"]
        if r["quantize_weights"] == "int8":
            extra += packed(s, 8, r["block"])
            if r["hierarchy"] == "hpz" and b["sharded"]:
                extra += nodes * packed(s, 8, r["block"]) - nodes * s * 4
            if not b["sharded"]:
                extra += 4 * s
        if "ef" in r["case"]:
            extra += 4 * b["padded"]
    return extra


REF_CASES = [(w, c) for w, c in ENGINE_CASES if c in ("s1-w8g8", "s1-w8g4ef", "s2-w8g8", "s2-w8g4ef", "s3-w8g8",
                                                      "s3-w8g4ef", "s3-w8g4ef-hpz")]


@pytest.mark.parametrize("world,case", REF_CASES, ids=[f"np{w}-{c}" for w, c in REF_CASES])
def test_state_bytes_and_distance_from_unquantized(results, world, case):
    r = results(world, *ARGS[world])[f"train/{case}"]
    assert r["state_bytes"] - r["ref_state_bytes"] == quantization_state_bytes(r)
    # three AdamW steps: quantisation moves the parameters by less than the update itself
    assert r["rel_to_unquantized"] < 0.75


@pytest.mark.parametrize("group", [("s3-w8g4ef", "s3-w8g4ef-overlap", "s3-w8g4ef-thread", "s3-w8g4ef-cpu",
                                    "s3-w8g4ef-nvme"),
                                   ("s2-w8g4ef", "s2-w8g4ef-nvme", "s2-w8g4ef-overlap")], ids=["stage3", "stage2"])
def test_offload_and_overlap_change_nothing(results, group):
    digests = {case: results(2, *ARGS[2])[f"train/{case}"]["digest"] for case in group}
    assert len(set(digests.values())) == 1, digests


def test_hpz_overlap_changes_nothing(results):
    rows = results(4, *ARGS[4])
    assert rows["train/s3-w8g4ef-hpz"]["digest"] == rows["train/s3-w8g4ef-hpz-overlap"]["digest"]


@pytest.mark.parametrize("world,case", [(2, "ckpt/s3"), (2, "ckpt/s1"), (3, "ckpt/s3")])
def test_checkpoint_resume_is_bitwise_and_other_world_drops_residuals(results, world, case):
    r = results(world, *ARGS[world])[case]
    assert r["bitwise"] and r["residual_norm"] > 0
    assert r["other_world_residuals"] and all(x == 0.0 for x in r["other_world_residuals"])
    assert all(math.isfinite(v) and v > 0 for v in r["other_world_loaded"].values())


@pytest.mark.parametrize("world", [2, 3])
def test_nan_gradient_raises_naming_rank_and_parameter(results, world):
    r = results(world, *ARGS[world])["nonfinite/raise"]
    assert r["error"] is not None and f"rank {world - 1}: transformer.h.1.mlp.c_fc.weight" in r["error"]


@pytest.mark.parametrize("case", ["nonfinite/skip", "nonfinite/fp16"])
def test_nan_gradient_skips_and_leaves_finite_state(results, case):
    r = results(2, *ARGS[2])[case]
    assert r["error"] is None and r["stepped"] == [True, False, True] and r["skipped"] == 1
    assert r["residual_after_skip"] == 0.0  # the skipped step's quantisation error is dropped with it
    assert r["residuals_finite"] and r["params_finite"]
