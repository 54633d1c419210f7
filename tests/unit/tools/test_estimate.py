"""zerompi.tools.estimate: the ZeRO paper's Table 1, the per-stage formulas, and `zerompi estimate`."""
from __future__ import annotations

import itertools
import json
import tomllib
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from zerompi.tools.cli import main
from zerompi.errors import ConfigError
from zerompi.tools.estimate import (communication_per_step, model_state_bytes, optimizer_bytes, parse_count,
                              parse_ranks, shard_numel)
from zerompi.models.gpt import GPT, gpt_config_from_dict

ROOT = Path(__file__).resolve().parents[3]

# ZeRO paper (arXiv:1910.02054) Table 1: per-device model-state memory in GB for
# Ψ = 7.5B, K = 12, fp16 compute, as printed (one decimal; two below 2 GB).
PAPER_ND = (1, 4, 16, 64, 256, 1024)
PAPER_TABLE1 = {
    1: ("120", "52.5", "35.6", "31.4", "30.4", "30.1"),    # P_os
    2: ("120", "41.3", "21.6", "16.6", "15.4", "15.1"),    # P_os+g
    3: ("120", "30", "7.5", "1.88", "0.47", "0.12"),       # P_os+g+p
}
# The same values from the formulas by hand, exactly, before rounding:
# P_os 4Ψ + 12Ψ/N, P_os+g 2Ψ + 14Ψ/N, P_os+g+p 16Ψ/N with Ψ = 7.5 GB-elements.
EXACT_GB = {
    1: (120, 52.5, 35.625, 31.40625, 30.3515625, 30.087890625),
    2: (120, 41.25, 21.5625, 16.640625, 15.41015625, 15.1025390625),
    3: (120, 30, 7.5, 1.875, 0.46875, 0.1171875),
}

C = {"fp32": 4, "bf16": 2, "fp16": 2}
STATE = {"adam": 8, "adamw": 8, "sgd": 4, "sgd-nomomentum": 0}


def paper_round(gb: Decimal) -> Decimal:
    """Table 1's rounding: half up, to 0.1 GB, or to 0.01 GB below 2 GB."""
    return gb.quantize(Decimal("0.01") if gb < 2 else Decimal("0.1"), rounding=ROUND_HALF_UP)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_zero_paper_table1(stage):
    for n, printed, exact in zip(PAPER_ND, PAPER_TABLE1[stage], EXACT_GB[stage]):
        m = model_state_bytes(7.5e9, n, stage, "fp16", "adam")
        gb = Decimal(m.device) / 10**9
        # Ψ/1024 is not whole: a rank holds ceil(Ψ/N) elements, a few bytes more than the exact value.
        assert abs(gb - Decimal(exact)) <= Decimal(16 * (n - 1)) / 10**9, (stage, n)
        assert paper_round(gb) == Decimal(printed), (stage, n, gb)


def test_zero_paper_baseline_and_k():
    assert optimizer_bytes("adam", "fp16") == 12
    for n in PAPER_ND:
        assert model_state_bytes(7.5e9, n, 0, "fp16", "adam").device == 120 * 10**9


def _by_formula(psi: int, n: int, stage: int, dtype: str, optimizer: str) -> tuple[int, int, int]:
    """README's table, in exact fractions: (parameters, gradients, optimizer state + master)."""
    c, k = C[dtype], STATE[optimizer] + (4 if dtype != "fp32" else 0)
    sharded = Fraction(psi, n)
    p = c * (sharded if stage == 3 else psi)
    g = c * (sharded if stage >= 2 else psi)
    o = k * (sharded if stage >= 1 else psi)
    return p, g, o


@pytest.mark.parametrize("dtype, optimizer", list(itertools.product(C, STATE)))
@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("offload", ("none", "cpu", "nvme"))
def test_formulas(stage, dtype, optimizer, offload):
    for psi, n in ((5040, 1), (5040, 2), (5040, 3), (5040, 7), (7_500_000_000, 64)):
        p, g, o = _by_formula(psi, n, stage, dtype, optimizer)
        m = model_state_bytes(psi, n, stage, dtype, optimizer, offload)
        assert (m.parameters, m.gradients, m.optimizer_state) == (p, g, o)
        assert m.total == p + g + o
        assert m.device == (m.total if offload == "none" else p + g)
        assert m.host == (o if offload == "cpu" else 0)
        assert m.nvme == (o if offload == "nvme" else 0)
        assert (m.params, m.ranks, m.stage, m.offload) == (psi, n, stage, offload)


@pytest.mark.parametrize("stage", range(4))
def test_uneven_shards_round_up(stage):
    # 10 parameters on 4 ranks: each rank holds a shard of 3 (the engine pads 10 to 12).
    assert shard_numel(10, 4) == 3
    m = model_state_bytes(10, 4, stage, "bf16", "adamw")
    assert m.parameters == 2 * (3 if stage == 3 else 10)
    assert m.gradients == 2 * (3 if stage >= 2 else 10)
    assert m.optimizer_state == 12 * (3 if stage >= 1 else 10)
    if stage == 3:  # fully sharded: the same as the padded count
        assert m.total == model_state_bytes(12, 4, stage, "bf16", "adamw").total


def test_k_values():
    assert [optimizer_bytes(o, "fp32") for o in STATE] == [8, 8, 4, 0]
    assert [optimizer_bytes(o, "bf16") for o in STATE] == [12, 12, 8, 4]
    assert optimizer_bytes("sgd", "fp16") == 8


@pytest.mark.parametrize("dtype", C)
@pytest.mark.parametrize("n", (1, 2, 3, 4, 64))
def test_communication(dtype, n):
    psi = 5040 * 64
    for stage in range(4):
        comm = communication_per_step(psi, n, stage, dtype)
        factor = 3 if stage == 3 else 2
        assert comm.elements == Fraction(factor * psi * (n - 1), n)
        assert comm.bytes == comm.elements * C[dtype]
        assert comm.collectives == factor
    assert communication_per_step(psi, 1, 3, dtype).elements == 0


@pytest.mark.parametrize("text, value", [
    ("7500000000", 7_500_000_000), ("7.5e9", 7_500_000_000), ("7.5B", 7_500_000_000),
    ("7.5b", 7_500_000_000), ("1.1B", 1_100_000_000), ("350M", 350_000_000), ("125k", 125_000),
    ("1T", 10**12), ("3_257_856", 3_257_856), ("1,000", 1000), (" 42 ", 42), ("2G", 2 * 10**9)])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "1.5", "nan", "inf", "7.5x", "B", "1e-3", "sNaN"])
def test_parse_count_rejects(text):
    with pytest.raises(ConfigError, match="not a whole number of parameters"):
        parse_count(text)


@pytest.mark.parametrize("text, values", [
    ("64", [64]), ("1,4,16,64,256,1024", [1, 4, 16, 64, 256, 1024]), ("1-4", [1, 2, 3, 4]),
    ("8-32:8", [8, 16, 24, 32]), ("1-1024*4", [1, 4, 16, 64, 256, 1024]), ("2,1-3", [2, 1, 3]),
    ("1-100*10", [1, 10, 100])])
def test_parse_ranks(text, values):
    assert parse_ranks(text) == values


@pytest.mark.parametrize("text", ["", "0", "a", "4-2", "1-8*1", "1-8:0", "2,,3", "-3", "1.5", "1-100000"])
def test_parse_ranks_rejects(text):
    with pytest.raises(ConfigError, match="--ranks"):
        parse_ranks(text)


@pytest.mark.parametrize("kwargs, message", [
    (dict(params=0), "params=0 is not a whole number"), (dict(params=1.5), "params=1.5"),
    (dict(params=float("nan")), "params=nan"), (dict(params=True), "params=True"),
    (dict(ranks=0), "ranks=0"), (dict(stage=4), "stage=4 is not one of"), (dict(stage=True), "stage=True"),
    (dict(dtype="fp8"), "dtype='fp8' is not one of 'fp32', 'bf16', 'fp16'"),
    (dict(optimizer="lamb"), "optimizer='lamb' is not one of"),
    (dict(offload="disk"), "offload='disk' is not one of 'none', 'cpu', 'nvme'")])
def test_bad_values_raise_config_error(kwargs, message):
    args = dict(params=1000, ranks=2, stage=1, dtype="fp32", optimizer="adamw", offload="none") | kwargs
    with pytest.raises(ConfigError, match=message.replace("(", "[(]").replace(")", "[)]")):
        model_state_bytes(**args)


# ---- the command line -----------------------------------------------------------------------

def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _grid(text: str, title: str) -> dict[int, list[str]]:
    """The rows of the table under ``title``: world size -> its cells."""
    lines = text.split(title, 1)[1].splitlines()
    rows = {}
    for line in lines[2:]:  # the rest of the title line, then the column header
        if not line.strip():
            break
        cells = line.split()
        rows[int(cells[0])] = cells[1:]
    return rows


def test_cli_paper_table(capsys):
    code, out, err = _run(capsys, "--params", "7.5e9", "--ranks", "1,4,16,64,256,1024",
                          "--dtype", "fp16", "--optimizer", "adam")
    assert code == 0 and err == ""
    assert "Ψ = 7,500,000,000 parameters (--params 7.5e9)" in out
    assert "fp16 compute: c = 2 bytes; adam: K = 12 bytes/param (8 optimizer state + 4 fp32 master)" in out
    gb = _grid(out, "on the device, GB (10^9 bytes):")
    assert gb[64] == ["120", "31.41", "16.64", "1.875"]
    assert gb[1024] == ["120", "30.09", "15.1", "0.1172"]
    gib = _grid(out, "on the device, GiB (2^30 bytes):")
    assert gib[1] == ["111.8"] * 4  # 120e9 / 2^30
    comm = _grid(out, "Sent per rank per optimizer step")
    assert comm[4] == ["22.5", "(11,250,000,000)", "33.75", "(16,875,000,000)"]
    assert "Per rank at N" not in out  # the breakdown is for a single world size


def test_cli_json_matches_paper(capsys):
    code, out, _ = _run(capsys, "--params", "7.5B", "--ranks", "1-1024*4", "--dtype", "fp16",
                        "--optimizer", "adam", "--json")
    doc = json.loads(out)
    assert code == 0
    assert (doc["params"], doc["compute_bytes"], doc["optimizer_bytes_per_param"]) == (7_500_000_000, 2, 12)
    assert doc["ranks"] == list(PAPER_ND) and len(doc["rows"]) == 4 * len(PAPER_ND)
    for row in doc["rows"]:
        i = PAPER_ND.index(row["ranks"])
        printed = "120" if row["stage"] == 0 else PAPER_TABLE1[row["stage"]][i]
        assert paper_round(Decimal(row["device_bytes"]) / 10**9) == Decimal(printed), row
        assert row["device_gb"] == pytest.approx(row["device_bytes"] / 1e9)
        assert row["device_gib"] == pytest.approx(row["device_bytes"] / 2**30)
        assert row["device_bytes"] == row["parameters_bytes"] + row["gradients_bytes"] + row["optimizer_bytes"]


@pytest.mark.parametrize("offload, where", [("cpu", "host memory"), ("nvme", "NVMe")])
def test_cli_offload_reports_device_and_elsewhere(capsys, offload, where):
    code, out, _ = _run(capsys, "--params", "1000", "--ranks", "4", "--dtype", "bf16", "--offload", offload)
    assert code == 0
    assert f"Optimizer state + master per rank in {where}, GB:" in out
    code, out, _ = _run(capsys, "--params", "1000", "--ranks", "4", "--dtype", "bf16", "--offload", offload,
                        "--json")
    rows = json.loads(out)["rows"]
    for row in rows:
        m = model_state_bytes(1000, 4, row["stage"], "bf16", "adamw", offload)
        assert row["device_bytes"] == m.parameters + m.gradients
        assert (row["host_bytes"], row["nvme_bytes"]) == (m.host, m.nvme)
        assert row["host_bytes"] + row["nvme_bytes"] == 12 * (1000 if row["stage"] == 0 else 250)


def test_cli_single_world_size_breakdown(capsys):
    code, out, _ = _run(capsys, "--params", "1e9", "--ranks", "8")
    assert code == 0
    assert "Per rank at N = 8, GB:" in out
    line = next(s for s in out.splitlines() if s.strip().startswith("3 P_os+g+p"))
    # fp32 AdamW, stage 3: 4Ψ/8 params, 4Ψ/8 grads, 8Ψ/8 optimizer = 0.5, 0.5, 1, device 2 GB
    assert line.split()[2:] == ["0.5", "0.5", "1", "2", "0"]


def _job_params(path: Path) -> int:
    """Build the job's GPT for real and count its distinct trainable parameters."""
    with open(path, "rb") as f:
        model = GPT(gpt_config_from_dict(tomllib.load(f)["model"]))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("config", ("default.toml", "tiny.toml"))
def test_cli_config_counts_the_jobs_gpt(capsys, config):
    path = ROOT / "jobs" / "configs" / config
    code, out, _ = _run(capsys, "--config", str(path), "--ranks", "2", "--json")
    doc = json.loads(out)
    expected = _job_params(path)
    assert code == 0 and doc["params"] == expected
    with open(path, "rb") as f:
        zero = tomllib.load(f)["zero"]
    assert (doc["dtype"], doc["optimizer"], doc["offload"]) == (zero["dtype"], zero["optimizer"], "none")
    for row in doc["rows"]:
        assert row["device_bytes"] == model_state_bytes(expected, 2, row["stage"], zero["dtype"],
                                                        zero["optimizer"]).device


def test_cli_config_meta_device_allocates_nothing(capsys, tmp_path):
    # A 7B-class [model] table is counted at once: the GPT is built on the meta device.
    path = _config(tmp_path, "[model]\nvocab_size = 50304\nblock_size = 2048\n"
                             "n_layer = 32\nn_head = 32\nn_embd = 4096\n")
    code, out, _ = _run(capsys, "--config", path, "--ranks", "64", "--dtype", "bf16", "--json")
    d, v, t, layers = 4096, 50304, 2048, 32
    per_block = 12 * d * d + 13 * d  # attention and MLP weights and biases, two LayerNorms
    assert code == 0 and json.loads(out)["params"] == v * d + t * d + layers * per_block + 2 * d


def test_cli_flags_override_the_config(capsys):
    path = ROOT / "jobs" / "configs" / "tiny.toml"
    code, out, _ = _run(capsys, "--config", str(path), "--ranks", "3", "--dtype", "bf16",
                        "--optimizer", "sgd", "--offload", "cpu", "--json")
    doc = json.loads(out)
    assert (doc["dtype"], doc["optimizer"], doc["offload"], doc["optimizer_bytes_per_param"]) == \
        ("bf16", "sgd", "cpu", 8)


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["--params", "lots", "--ranks", "2"], "--params 'lots' is not a whole number of parameters"),
    (["--params", "0", "--ranks", "2"], "--params '0' is not a whole number"),
    (["--params", "1e9", "--ranks", "0"], "--ranks '0' is not a list of world sizes"),
    (["--params", "1e9", "--ranks", "2", "--dtype", "fp8"], "dtype='fp8' is not one of 'fp32', 'bf16', 'fp16'"),
    (["--params", "1e9", "--ranks", "2", "--optimizer", "lamb"], "optimizer='lamb' is not one of"),
    (["--params", "1e9", "--ranks", "2", "--offload", "tape"], "offload='tape' is not one of"),
    (["--config", "/nonexistent/job.toml", "--ranks", "2"], "--config /nonexistent/job.toml: cannot read it"),
])
def test_cli_errors_exit_2(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("zerompi estimate: ") and message in err, err


@pytest.mark.parametrize("text, message", [
    ("[zero]\nstage = 3\n", "no [model] table"),
    ("[model\n", "cannot read it"),
    ("[model]\nwidth = 3\n", "unknown GPT config key(s): width"),
    ("[model]\nn_embd = 30\nn_head = 4\n", "n_embd (30) must be divisible by n_head (4)"),
    ("[model]\nn_layer = 'two'\n", "[model]: "),
    ("[model]\n[zero]\nstage = 9\n", "[zero]: stage=9"),
    ("[model]\n[zero]\noptimizer = 'torch.optim.Adagrad'\n", "pass --optimizer"),
])
def test_cli_bad_configs_exit_2(capsys, tmp_path, text, message):
    code, out, err = _run(capsys, "--config", _config(tmp_path, text), "--ranks", "2")
    assert code == 2 and out == ""
    assert message in err, err


def test_cli_custom_optimizer_with_flag(capsys, tmp_path):
    path = _config(tmp_path, "[model]\nn_layer = 1\n[zero]\noptimizer = 'torch.optim.Adagrad'\n")
    code, out, _ = _run(capsys, "--config", path, "--ranks", "2", "--optimizer", "sgd", "--json")
    assert code == 0 and json.loads(out)["optimizer"] == "sgd"


def test_cli_sgd_without_momentum_from_config(capsys, tmp_path):
    path = _config(tmp_path, "[model]\nn_layer = 1\n[zero]\noptimizer = 'sgd'\nlr = 0.1\n")
    code, out, _ = _run(capsys, "--config", path, "--ranks", "2", "--json")
    assert json.loads(out)["optimizer"] == "sgd-nomomentum"
    assert json.loads(out)["optimizer_bytes_per_param"] == 0


@pytest.mark.parametrize("argv", [
    ["--ranks", "2"],                                                  # neither --params nor --config
    ["--params", "1e9"],                                               # no --ranks
    ["--params", "1e9", "--config", "jobs/configs/tiny.toml", "--ranks", "2"],  # both
])
def test_cli_usage_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["estimate", *argv])
    assert e.value.code == 2
    assert "usage: zerompi estimate" in capsys.readouterr().err


def test_meta_device_count_equals_real_count():
    cfg = gpt_config_from_dict({"n_layer": 2, "n_embd": 64, "n_head": 4, "tie_weights": False})
    with torch.device("meta"):
        meta = sum(p.numel() for p in GPT(cfg).parameters())
    assert meta == sum(p.numel() for p in GPT(cfg).parameters())


def test_frozen_parameters_replicated_below_stage3_sharded_at_stage3():
    """Ψ = 10 trainable, Ψ_f = 7 frozen, N = 4, bf16 AdamW: frozen costs c per element, sharded at stage 3."""
    c, k = 2, 12
    for stage, (params, grads, opt, frozen) in enumerate([(10, 10, 10, 7), (10, 10, 3, 7), (10, 3, 3, 7),
                                                          (3, 3, 3, 2)]):
        m = model_state_bytes(10, 4, stage, "bf16", "adamw", frozen=7)
        assert (m.parameters, m.gradients, m.optimizer_state, m.frozen) == (c * params, c * grads, k * opt, c * frozen)
        assert m.total == model_state_bytes(10, 4, stage, "bf16", "adamw").total + c * frozen
    # stage 3 gathers the frozen shards in forward and backward: 2 Ψ_f (N-1)/N more, never reduced
    assert communication_per_step(10, 4, 3, "bf16", frozen=7).elements == 3 * 3 * 3 + 2 * 3 * 2
    assert communication_per_step(10, 4, 2, "bf16", frozen=7).elements == 2 * 3 * 3
    with pytest.raises(ConfigError, match="frozen=-1"):
        model_state_bytes(10, 4, 3, frozen=-1)


def test_cli_frozen_params(capsys):
    from zerompi.tools.cli import main
    assert main(["estimate", "--params", "20M", "--frozen-params", "7B", "--ranks", "8", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "Ψ_f = 7,000,000,000 frozen parameters" in out and "+ 2Ψ_f(N-1)/N" in out
    line = next(s for s in out.splitlines() if s.strip().startswith("3 P_os+g+p"))
    assert line.split()[5] == "1.75"  # 2 bytes x 7e9 / 8 ranks, GB
    assert main(["estimate", "--params", "20M", "--frozen-params=-5", "--ranks", "8"]) == 2
    assert "--frozen-params '-5' is not a whole number of parameters >= 0" in capsys.readouterr().err
# ---- quantized collectives: bytes per step and the α-β projection -----------------------------

def _packed(numel: int, bits: int, block: int) -> int:
    """A packed chunk by hand: one fp32 scale per block, then bits/8 bytes per code (int4 rounded up)."""
    return 4 * -(-numel // block) + (numel if bits == 8 else -(-numel // 2))


@pytest.mark.parametrize("params,n,block", [(10**6, 2, 256), (7_654_321, 3, 256), (123_457, 16, 64), (2**20, 1024, 256)])
def test_quantized_bytes_per_step_are_the_packed_chunks(capsys, params, n, block):
    code, out, _ = _run(capsys, "--params", str(params), "--ranks", str(n), "--quantize-weights", "int8",
                        "--quantize-grads", "int4", "--quant-block", str(block), "--json")
    assert code == 0
    rows = {r["stage"]: r for r in json.loads(out)["communication"]["rows"]}
    s = -(-params // n)
    w, g = (n - 1) * _packed(s, 8, block), (n - 1) * _packed(s, 4, block)
    assert rows[3]["bytes_by_kind"] == {"all_gather.int8": 2 * w, "reduce_scatter.int4": g}
    assert rows[1]["bytes_by_kind"] == rows[2]["bytes_by_kind"] == {"all_gather.int8": w, "reduce_scatter.int4": g}
    assert rows[3]["unquantized_bytes"] == 3 * (n - 1) * s * 4 == communication_per_step(params, n, 3).bytes


def test_int8_weights_cost_one_and_four_256ths_bytes_per_element(capsys):
    _, out, _ = _run(capsys, "--params", str(256 * 1000 * 4), "--ranks", "4", "--quantize-weights", "int8", "--json")
    row = next(r for r in json.loads(out)["communication"]["rows"] if r["stage"] == 3)
    s = 256 * 1000
    assert row["bytes_by_kind"] == {"all_gather.int8": 2 * 3 * s * (1 + 4 / 256), "reduce_scatter": 3 * s * 4}


def test_alpha_beta_time_is_the_sum_over_collectives(capsys):
    _, out, _ = _run(capsys, "--params", "1e9", "--ranks", "64", "--dtype", "bf16", "--quantize-weights", "int8",
                     "--quantize-grads", "int8", "--link-gbps", "25", "--latency-us", "10", "--json")
    doc = json.loads(out)["communication"]
    row = next(r for r in doc["rows"] if r["stage"] == 3)
    s, alpha, beta = -(-10**9 // 64), 10e-6, 25e9 / 8  # bytes per second
    chunk = _packed(s, 8, 256)
    assert row["seconds"] == pytest.approx(3 * 63 * (alpha + chunk / beta), rel=1e-12)
    assert row["unquantized_seconds"] == pytest.approx(3 * 63 * (alpha + 2 * s / beta), rel=1e-12)
    assert (doc["link_gbps"], doc["latency_us"]) == (25.0, 10.0)


def test_quantized_section_in_the_text(capsys):
    code, out, _ = _run(capsys, "--params", "7.5B", "--ranks", "16,1024", "--dtype", "bf16", "--quantize-weights",
                        "int8", "--quantize-grads", "int4")
    assert code == 0
    assert "weights int8, gradients int4 (block 256)" in out and "100 Gb/s, 5 µs" in out
    stage3 = [line.split() for line in out.splitlines() if line.split()[:2] in (["16", "3"], ["1024", "3"])]
    assert [row[-1] for row in stage3] == ["0.424", "0.424"]  # (2 (1 + 4/256) + (1/2 + 4/256)) / (3 * 2)


@pytest.mark.parametrize("argv,match", [
    (["--quantize-weights", "int4"], "--quantize-weights 'int4'"), (["--quantize-grads", "int2"], "--quantize-grads"),
    (["--quant-block", "255"], "--quant-block 255"), (["--link-gbps", "0"], "--link-gbps"),
    (["--latency-us", "-1"], "--latency-us"), (["--link-gbps", "nan"], "--link-gbps")])
def test_bad_quantization_flags_name_the_flag(capsys, argv, match):
    code, _, err = _run(capsys, "--params", "1e6", "--ranks", "4", *argv)
    assert code == 2 and match in err
