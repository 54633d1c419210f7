"""DeepSpeed configs as people write them: Hugging Face's ZeRO-2/ZeRO-3 templates and DeepSpeedExamples.

The templates are written out from their documented contents (transformers' DeepSpeed
integration guide): every "auto" there is what Hugging Face's Trainer fills in, and zerompi
fills it from ``overrides``, ZeroConfig's defaults or the model. Tests of the stage-3 sizes
with a model read the translation's keyword arguments where ``param_persistence_threshold``
appears; the one that builds a ZeroConfig from them skips until that field exists.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from types import SimpleNamespace

import pytest
from torch import nn

from zerompi.compat.deepspeed import config_from
from zerompi.config import ZeroConfig
from zerompi.compat.deepspeed.config import NO_EFFECT, deepspeed_kwargs, translate
from zerompi.compat.deepspeed.auto import hidden_size
from zerompi.compat.deepspeed.batch import Batch, BatchKeys, complete_batch
from zerompi.errors import ConfigError
from zerompi.models.gpt import GPT, GPTConfig

HAS_PERSISTENCE = "param_persistence_threshold" in {f.name for f in dataclasses.fields(ZeroConfig)}
needs_persistence = pytest.mark.skipif(not HAS_PERSISTENCE, reason="ZeroConfig has no param_persistence_threshold yet")

_COMMON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO2 = {**_COMMON, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
    "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
    "contiguous_gradients": True, "round_robin_gradients": True}}
HF_ZERO3 = {**_COMMON, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}
# DeepSpeedExamples training/cifar/ds_config.json, as that example ships it.
CIFAR = {
    "train_batch_size": 16, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False,
    "fp16": {"enabled": True, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                          "contiguous_gradients": True, "cpu_offload": False},
}


def from_deepspeed(doc, model=None, **overrides):
    """zerompi.compat.deepspeed.config_from and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from(copy.deepcopy(doc), model, **overrides)
    return cfg, [str(w.message) for w in caught]


def warned_keys(message: str) -> set[str]:
    listed = message.split("replace): ", 1)[1].split(";", 1)[0]
    return set(listed.split(", "))


def test_hf_zero2_template_without_model():
    cfg, warned = from_deepspeed(HF_ZERO2)
    assert (cfg.stage, cfg.offload_optimizer, cfg.pin_memory, cfg.overlap_grad_reduce) == (2, "cpu", True, True)
    assert cfg.bucket_mb == pytest.approx(2e8 * 4 / 2**20)
    # Every training "auto" took ZeroConfig's default; both precision switches are off.
    defaults = ZeroConfig()
    for name in ("lr", "betas", "eps", "weight_decay", "grad_accum_steps", "clip_grad_norm"):
        assert getattr(cfg, name) == getattr(defaults, name), name
    assert cfg.dtype == "fp32" and cfg.lr_schedule == "constant"
    assert len(warned) == 1  # the tuning keys; WarmupLR without warm-up keeps lr: nothing to say about it
    assert warned_keys(warned[0]) == {
        "steps_per_print", "wall_clock_breakdown", "zero_optimization.allgather_partitions",
        "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter",
        "zero_optimization.round_robin_gradients"}
    assert "scheduler" not in warned[0]


def test_hf_zero2_template_with_overrides():
    cfg, warned = from_deepspeed(HF_ZERO2, lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                                 grad_accum_steps=4, clip_grad_norm=0.5, dtype="bf16", warmup_steps=10)
    assert (cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay) == (3e-4, (0.9, 0.95), 1e-6, 0.1)
    assert (cfg.grad_accum_steps, cfg.clip_grad_norm, cfg.dtype) == (4, 0.5, "bf16")
    # A warm-up now changes the learning rate: only zerompi.deepspeed applies the scheduler block.
    assert len(warned) == 1 and "scheduler.type='WarmupLR' is applied by zerompi.deepspeed.initialize" in warned[0]
    t = translate(HF_ZERO2, None, {"warmup_steps": 10, "lr": 3e-4})
    assert (t.schedule.warmup_num_steps, t.schedule.warmup_min_lr, t.schedule.warmup_max_lr) == (10, 0.0, 3e-4)


def test_hf_zero3_template_without_model():
    cfg, warned = from_deepspeed(HF_ZERO3)
    assert (cfg.stage, cfg.offload_optimizer, cfg.offload_params, cfg.overlap_grad_reduce) == (3, "cpu", "cpu", True)
    # The "auto" sizes need a model; without one zerompi's defaults stay.
    assert (cfg.bucket_mb, cfg.prefetch_units) == (ZeroConfig().bucket_mb, 0)
    assert "param_persistence_threshold" not in deepspeed_kwargs(HF_ZERO3)
    assert len(warned) == 1 and warned_keys(warned[0]) == {
        "steps_per_print", "wall_clock_breakdown", "zero_optimization.contiguous_gradients",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_max_reuse_distance"}


def tiny_gpt(n_embd=64):
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=n_embd))


def test_hf_zero3_sizes_from_the_model():
    kwargs = deepspeed_kwargs(HF_ZERO3, tiny_gpt(64))
    assert kwargs["bucket_mb"] == 64 * 64 * 4 / 2**20  # reduce_bucket_size = h^2
    assert kwargs["prefetch_units"] == 1  # 0.9 h^2 fits in one unit of h^2 elements
    assert kwargs["param_persistence_threshold"] == 640  # 10 h


@needs_persistence
def test_hf_zero3_template_with_model():
    cfg, warned = from_deepspeed(HF_ZERO3, tiny_gpt(64))
    assert (cfg.bucket_mb, cfg.prefetch_units, cfg.param_persistence_threshold) == (64 * 64 * 4 / 2**20, 1, 640)
    assert len(warned) == 1


def test_deepspeed_examples_cifar():
    cfg, warned = from_deepspeed(CIFAR)
    assert (cfg.stage, cfg.optimizer, cfg.lr, cfg.betas, cfg.weight_decay) == (0, "adamw", 0.001, (0.8, 0.999), 3e-7)
    assert (cfg.dtype, cfg.loss_scale_window, cfg.initial_scale_power, cfg.clip_grad_norm) == ("fp16", 500, 15, 1.0)
    assert len(warned) == 1
    assert "prescale_gradients" in warned_keys(warned[0])
    assert "scheduler.type='WarmupLR' is applied by zerompi.deepspeed.initialize" in warned[0]


def test_no_warning_without_tuning_keys():
    _, warned = from_deepspeed({"zero_optimization": {"stage": 1}, "train_batch_size": 8})
    assert warned == []


def test_every_no_effect_key_is_warned_about():
    doc = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {}}}
    for dotted, kind in NO_EFFECT.items():
        *parents, leaf = dotted.split(".")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = {"bool": True, "size": 7, "ratio": 0.5, "any": "x"}[kind]
    _, warned = from_deepspeed(doc)
    assert len(warned) == 1 and warned_keys(warned[0]) == set(NO_EFFECT)


@pytest.mark.parametrize("size,units,units_of_twice", [(0, 0, 0), (1, 1, 1), (4096, 1, 1), (4097, 2, 1),
                                                     (8193, 3, 2), (5e7, 8, 8)])
def test_prefetch_bucket_size_to_units(size, units, units_of_twice):
    doc = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": size}}
    assert config_from(doc).prefetch_units == units
    # The unit is the bucket the config ends with, overrides included.
    assert config_from(doc, bucket_mb=2 * 4096 * 4 / 2**20).prefetch_units == units_of_twice


def test_persistence_threshold_in_kwargs():
    assert deepspeed_kwargs({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5}}) \
        ["param_persistence_threshold"] == 100000
    with pytest.raises(ConfigError, match=r"zero_optimization.stage3_param_persistence_threshold=-1"):
        deepspeed_kwargs({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": -1}})


def test_stage3_sizes_below_stage3_have_no_effect():
    doc = {"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 5e7,
                                 "stage3_param_persistence_threshold": 1e5}}
    kwargs = deepspeed_kwargs(doc)
    assert "prefetch_units" not in kwargs and "param_persistence_threshold" not in kwargs
    _, warned = from_deepspeed(doc)
    assert warned_keys(warned[0]) == {"zero_optimization.stage3_prefetch_bucket_size",
                                      "zero_optimization.stage3_param_persistence_threshold"}


def test_zeropp_maps_onto_quantized_collectives_and_hpz():
    """DeepSpeed's qwZ is int8 weight all-gathers, its qgZ int4 gradient reduce-scatters; hpZ's partition
    size becomes the hpz hierarchy over groups of that many consecutive ranks."""
    cfg, warned = from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                        "zero_quantized_gradients": True, "zero_hpz_partition_size": 8.0}})
    assert (cfg.quantize_weights, cfg.quantize_grads, cfg.hierarchy, cfg.ranks_per_node) == ("int8", "int4", "hpz", 8)
    assert not warned
    cfg, _ = from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_weights": False,
                                                   "zero_quantized_gradients": False, "zero_hpz_partition_size": 1}})
    assert (cfg.quantize_weights, cfg.quantize_grads, cfg.hierarchy, cfg.ranks_per_node) == ("none", "none", "flat", None)


def test_zeropp_below_stage3_has_no_effect():
    doc = {"zero_optimization": {"stage": 2, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                 "zero_hpz_partition_size": 4}}
    kwargs = deepspeed_kwargs(doc)
    assert not {"quantize_weights", "quantize_grads", "hierarchy"} & set(kwargs)
    _, warned = from_deepspeed(doc)
    assert warned_keys(warned[0]) == {"zero_optimization.zero_quantized_weights",
                                      "zero_optimization.zero_quantized_gradients",
                                      "zero_optimization.zero_hpz_partition_size"}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("key,value", [("zero_quantized_weights", 1), ("zero_quantized_gradients", "yes"),
                                       ("zero_hpz_partition_size", 0), ("zero_hpz_partition_size", 2.5)])
def test_zeropp_values_are_checked(stage, key, value):
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{key}="):
        deepspeed_kwargs({"zero_optimization": {"stage": stage, key: value}})


def test_hidden_size():
    assert hidden_size(None) is None
    assert hidden_size(tiny_gpt(32)) == 32  # GPTConfig.n_embd
    hf = nn.Linear(3, 3)
    hf.config = SimpleNamespace(hidden_size=768)
    assert hidden_size(hf) == 768
    hf.config = SimpleNamespace(hidden_sizes=[64, 256, 128])
    assert hidden_size(hf) == 256
    assert hidden_size(nn.Sequential(nn.Linear(5, 40), nn.Linear(40, 3))) == 40  # largest in_features
    assert hidden_size(nn.Sequential(nn.Conv1d(1, 1, 1))) is None


def test_fp16_auto_follows_the_dtype_override():
    assert from_deepspeed(HF_ZERO2, dtype="fp16")[0].dtype == "fp16"
    kwargs = deepspeed_kwargs(HF_ZERO2, overrides={"dtype": "fp16"})
    assert kwargs["dtype"] == "fp16"


def test_unresolvable_auto_names_the_key_and_what_to_pass():
    doc = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}
    with pytest.raises(ConfigError, match=r"scheduler.params.total_num_steps='auto' cannot be resolved.*total_steps"):
        config_from(doc)
    t = translate(doc, None, {"total_steps": 100, "warmup_steps": 5})
    assert (t.schedule.total_num_steps, t.schedule.warmup_num_steps) == (100, 5)
    with pytest.raises(ConfigError, match=r"^zero_optimization.stage='auto'"):
        config_from({"zero_optimization": {"stage": "auto"}})


def test_unsupported_keys_still_in_one_error():
    doc = copy.deepcopy(HF_ZERO3)
    doc["zero_optimization"]["zeropp_loco_param"] = {"err_beta": 0.8}
    doc["scheduler"]["params"]["cycle_min_lr"] = 0.1
    doc["communication_data_type"] = "fp16"
    doc["fp16"]["fp16_master_weights"] = True
    with pytest.raises(ConfigError) as err:
        config_from(doc)
    assert str(err.value) == ("unsupported DeepSpeed config keys: communication_data_type, fp16.fp16_master_weights, "
                              "scheduler.params.cycle_min_lr, zero_optimization.zeropp_loco_param")


@pytest.mark.parametrize("doc,match", [
    ({"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, r"optimizer.type='Lamb'"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, r"fp16.auto_cast=True is not supported: .*; allowed: false"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, r"fp16.fp16_master_weights_and_grads=True"),
    ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     r"zero_optimization.cpu_offload and zero_optimization.offload_optimizer are both given"),
    ({"zero_optimization": {"round_robin_gradients": "yes"}}, r"zero_optimization.round_robin_gradients='yes'"),
    ({"zero_optimization": {"sub_group_size": -1}}, r"zero_optimization.sub_group_size=-1"),
])
def test_what_would_change_the_result_raises(doc, match):
    with pytest.raises(ConfigError, match=match):
        config_from(doc)


@pytest.mark.parametrize("keys,world,expected", [
    (BatchKeys(32, 4, 2), 4, Batch(32, 4, 2)),
    (BatchKeys(32, 4, None), 2, Batch(32, 4, 4)),    # accumulation derived
    (BatchKeys(32, None, 2), 4, Batch(32, 4, 2)),    # micro batch derived
    (BatchKeys(None, 4, 3), 2, Batch(24, 4, 3)),     # global batch derived
    (BatchKeys(16, None, None), 2, Batch(16, 8, 1)),
    (BatchKeys(None, 8, None), 3, Batch(24, 8, 1)),
    (BatchKeys(None, None, 2), 2, Batch(None, None, 2)),
])
def test_batch_keys_completed_as_deepspeed_does(keys, world, expected):
    assert complete_batch(keys, world) == expected


@pytest.mark.parametrize("keys,world", [(BatchKeys(32, 4, 2), 2), (BatchKeys(10, 4, None), 2),
                                        (BatchKeys(4, None, 8), 1)])
def test_inconsistent_batch_keys_name_them(keys, world):
    with pytest.raises(ConfigError, match=r"train_batch_size=.* must equal train_micro_batch_size_per_gpu \* "
                                          r"gradient_accumulation_steps \* world size"):
        complete_batch(keys, world)


def test_batch_keys_checked_for_type():
    with pytest.raises(ConfigError, match=r"^train_micro_batch_size_per_gpu=0"):
        config_from({"train_micro_batch_size_per_gpu": 0})
    assert math.isclose(config_from({"train_batch_size": "auto"}).lr, 1e-3)
