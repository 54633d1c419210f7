"""Hugging Face's DeepSpeed config templates, read verbatim from hf_templates/.

hf_templates/ holds the DeepSpeed JSON files of transformers' tests/deepspeed/ (ds_config_zero2,
ds_config_zero3, the older ds_config_zero2_bf16 / ds_config_zero3_bf16 in the "bfloat16" spelling, and
ds_config_zero3_fixed: the earlier ds_config_zero3 with numbers instead of "auto") and of accelerate's
tests/deepspeed/ (accelerate_*), unchanged (Apache-2.0). Each must be accepted as it is, without a
model and with one (the stage-3 sizes' "auto" follow its hidden size), with the values Hugging Face's
Trainer fills "auto" from, and say what DeepSpeed 0.19.8 would make of it.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from zerompi.compat.deepspeed import config_from
from zerompi.compat.deepspeed.config import translate

TEMPLATES = sorted((Path(__file__).parent / "hf_templates").glob("*.json"))
# What the Trainer fills "auto" with (TrainingArguments and the model), as config_from's overrides.
TRAINER = {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "grad_accum_steps": 1,
           "clip_grad_norm": 1.0, "warmup_steps": 0}


def load(name: str) -> dict:
    return json.loads((Path(__file__).parent / "hf_templates" / name).read_text())


def model(hidden: int = 64) -> nn.Module:
    m = nn.Linear(hidden, hidden)
    m.config = SimpleNamespace(hidden_size=hidden)  # what a transformers model carries
    return m


def accepted(doc: dict, m: nn.Module | None = None, **overrides):
    """The ZeroConfig and the one warning it may give, which names keys without effect only."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from(doc, m, **overrides)
    assert len(caught) <= 1
    for w in caught:
        assert str(w.message).startswith("DeepSpeed config keys accepted with no effect in zerompi")
    return cfg


def test_the_templates_are_there():
    assert len(TEMPLATES) == 9


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
@pytest.mark.parametrize("with_model", [False, True], ids=["no-model", "model"])
@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_each_template_is_accepted_verbatim(path, with_model, dtype):
    doc = json.loads(path.read_text())
    overrides = {**TRAINER, "dtype": dtype} if dtype else {}
    cfg = accepted(doc, model() if with_model else None, **overrides)
    zero = doc["zero_optimization"]
    assert cfg.stage == zero["stage"]
    assert cfg.offload_optimizer == zero["offload_optimizer"]["device"]
    assert cfg.offload_params == zero.get("offload_param", {}).get("device", "none")
    assert cfg.pin_memory and cfg.overlap_grad_reduce
    # "enabled": "auto" follows the dtype override (the Trainer's --bf16 / --fp16), else it is off
    assert cfg.dtype == dtype or (dtype is None and cfg.dtype == ("fp16" if "fixed" in path.stem else "fp32"))
    if dtype:  # overrides apply on top of the file, numbers included
        assert (cfg.lr, cfg.clip_grad_norm) == (TRAINER["lr"], TRAINER["clip_grad_norm"])
    if with_model and zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == "auto":
        assert cfg.param_persistence_threshold == 640  # 10 * hidden size, as the Trainer fills it


def test_fixed_numbers_are_taken_as_deepspeed_takes_them():
    cfg = accepted(load("ds_config_zero3_fixed.json"))
    assert (cfg.dtype, cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay) == ("fp16", 3e-5, (0.8, 0.999), 1e-8, 3e-7)
    assert cfg.clip_grad_norm == 1.0  # no gradient_clipping: DeepSpeed 0.19.8's default
    assert (cfg.param_persistence_threshold, cfg.prefetch_units, cfg.max_live_params) == (0, 0, 10**9)
    assert (cfg.initial_scale_power, cfg.loss_scale_window, cfg.hysteresis, cfg.min_loss_scale) == (16, 1000, 2, 1)
    t = translate(load("ds_config_zero3_fixed.json"))
    assert t.gather_16bit and (t.schedule.warmup_num_steps, t.schedule.warmup_max_lr) == (500, 3e-5)


def test_the_old_bfloat16_spelling():
    assert accepted(load("ds_config_zero2_bf16.json"), dtype="bf16").dtype == "bf16"
    doc = load("ds_config_zero3_bf16.json")
    doc["bfloat16"]["enabled"] = True
    assert accepted(doc).dtype == "bf16"


def test_accelerate_templates():
    cfg = accepted(load("accelerate_ds_config_zero2.json"), **TRAINER)
    assert (cfg.optimizer, cfg.grad_accum_steps) == ("adamw", 1)  # torch_adam, adam_w_mode: AdamW either way
    # nvme_path beside device 'cpu' is unused, as in DeepSpeed; "auto" for the 16-bit save is its default (off)
    assert accepted(load("accelerate_ds_config_zero3.json")).offload_params == "cpu"
    assert not translate(load("accelerate_ds_config_zero3.json")).gather_16bit
    only = accepted(load("accelerate_ds_config_zero3_model_only.json"), model())
    assert (only.stage, only.clip_grad_norm, only.param_persistence_threshold) == (3, 1.0, 640)
