"""CPU and NVMe offload on real ranks and real O_DIRECT swap files (workers/offload.py).

Offload moves where state lives, never what is computed: 'none', 'cpu' and
'nvme' must give bitwise identical parameters, checkpoints must move between
them bitwise, and with 'nvme' the master weights and optimizer state must
not stay resident between steps.
"""
from __future__ import annotations

import os

import pytest

from .launcher import run_worker_json


@pytest.fixture(scope="module", params=(2, 3), ids=lambda n: f"np{n}")
def result(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"offload{request.param}")
    swap = base / "swap"
    swap.mkdir()
    res = run_worker_json(request.param, "offload.py", base / "r.json", "--swap", str(swap),
                          "--root", str(base / "ckpt"))
    res["world"] = request.param
    res["swap_after_exit"] = sorted(os.listdir(swap))
    return res


def test_offload_modes_are_bitwise_identical(result):
    for row in result["parity"]:
        assert all(row["identical"].values()), row
    accumulated = [row for row in result["parity"] if row.get("accum") == 2]
    assert [row["stage"] for row in accumulated] == [2, 3]
    for row in accumulated:  # the clip (0.05) was in force, and the swapped norm is the same number
        norms = {r["mode"]: r["grad_norm"] for r in row["rows"]}
        assert norms["none"] > 0.05 and norms["none"] == norms["nvme"], norms


def test_nvme_keeps_master_and_optimizer_state_out_of_memory(result):
    n = result["world"]
    for row in result["parity"]:
        by_mode = {r["mode"]: r for r in row["rows"]}
        p = by_mode["none"]["padded"]
        c = 4 if row["dtype"] == "fp32" else 2
        stage = row["stage"]
        # resident: compute-dtype parameters and gradients only; stage 3 parameter shards and
        # stage 2-3 gradient shards are swapped too
        params = 0 if stage == 3 else c * p
        grads = c * p if stage < 2 else 0
        assert by_mode["nvme"]["model_state_bytes"] == params + grads, row
        # master + two Adam moments per rank, plus the gradient shard at stages 2-3
        assert by_mode["nvme"]["swapped"] >= (12 + (c if stage >= 2 else 0)) * p // n, row
        assert by_mode["none"]["swapped"] == by_mode["cpu"]["swapped"] == 0


def test_cpu_offload_on_a_cpu_device_keeps_one_copy(result):
    # The device is the CPU, so the fp32 shard is in host memory already: 'cpu' offload must not
    # add a second master beside it (it would train smaller models than no offload).
    for row in result["parity"]:
        by_mode = {r["mode"]: r for r in row["rows"]}
        assert by_mode["cpu"]["model_state_bytes"] == by_mode["none"]["model_state_bytes"], row


def test_nvme_parameter_shards_are_read_ahead(result):
    # Stage 3 with offload_params='nvme': forward and backward read each next unit's shard from
    # the swap file before it is needed (parity above shows the read-ahead changes no value).
    for row in (r for r in result["parity"] if r["stage"] == 3):
        nvme = next(r for r in row["rows"] if r["mode"] == "nvme")
        assert nvme["units"] > 2, nvme
        # the first step records the order; the next two read at least every unit but one ahead
        assert nvme["read_ahead"] >= 2 * (nvme["units"] - 1), nvme


def test_checkpoints_move_between_offload_modes(result):
    for stage, pairs in result["checkpoint"].items():
        assert pairs == {"nvme->none": True, "none->nvme": True}, (stage, pairs)


def test_missing_swap_directory_fails_on_every_rank(result):
    messages = result["missing_dir"]
    assert len(messages) == result["world"]
    for m in messages:
        assert m.startswith("ZeroMPIError") and "missing" in m and "does not exist" in m, m


def test_swap_files_are_removed(result):
    assert result["left_behind"] == [] and result["swap_after_exit"] == []


def test_nvme_resident_memory_does_not_grow_with_the_model(tmp_path):
    """Peak RSS per rank for a deeper GPT (the benchmark's capacity worker: meta-device build,
    two AdamW steps, 2 ranks): stage 0 from 2 to 16 layers grows by its whole model state (the
    measurement sees it); stage 3 with NVMe offload from 8 to 16 layers must grow by under a tenth
    of that. Both NVMe depths are past what is in flight at once whatever the depth (three units
    read ahead, their optimizer state, two buckets written behind, the pool of released blocks)."""
    import json

    from .launcher import run_mpi

    swap = tmp_path / "swap"
    swap.mkdir()
    peak, params = {}, {}
    for mode, depths in (("stage0", (2, 16)), ("stage3+nvme", (8, 16))):
        for layers in depths:
            out = tmp_path / f"{mode}-{layers}.json"
            run_mpi(2, "benchmarks/workers/capacity_worker.py", "--mode", mode, "--n-layer", str(layers),
                    "--n-embd", "512", "--n-head", "8", "--nvme", str(swap), "--out", str(out))
            row = json.loads(out.read_text())
            assert row["finite"], row
            peak[mode, layers], params[layers] = max(r["peak_rss"] for r in row["ranks"]), row["params"]
    state = 16 * (params[16] - params[2])  # fp32 AdamW: parameter, gradient, two moments
    assert peak["stage0", 16] - peak["stage0", 2] > 0.8 * state, (peak, state)
    assert peak["stage3+nvme", 16] - peak["stage3+nvme", 8] < 0.1 * state, (peak, state)
