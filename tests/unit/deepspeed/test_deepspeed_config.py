"""DeepSpeed configs as people write them: Hugging Face's ZeRO-2/ZeRO-3 templates and DeepSpeedExamples.

The templates are written out from their documented contents (transformers' DeepSpeed
integration guide): every "auto" there is what Hugging Face's Trainer fills in, and zerompi
fills it from ``overrides``, ZeroConfig's defaults or the model. The stage-3 sizes a model
gives are checked in the translation's keyword arguments and in the ZeroConfig built from them.
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
        node[leaf] = {"bool": True, "size": 7, "interval": 7, "ratio": 0.5, "any": "x"}[kind]
    _, warned = from_deepspeed(doc)
    assert len(warned) == 1 and warned_keys(warned[0]) == set(NO_EFFECT)


def test_steps_per_print_may_be_inf():
    """accelerate writes steps_per_print: inf (never); a negative interval is still refused."""
    _, warned = from_deepspeed({"steps_per_print": float("inf")})
    assert "steps_per_print" in warned_keys(warned[0])
    with pytest.raises(ConfigError, match=r"steps_per_print=-1"):
        from_deepspeed({"steps_per_print": -1})


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
    doc["fp16"]["fp16_master_weights"] = True
    with pytest.raises(ConfigError) as err:
        config_from(doc)
    assert str(err.value) == ("unsupported DeepSpeed config keys: fp16.fp16_master_weights, "
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


# ---- DeepSpeed 0.19.8's other spellings, disabled blocks, aio, features zerompi lacks --------------

# Hugging Face's ZeRO-3 NVMe template (transformers' DeepSpeed guide), with its older spellings.
HF_ZERO3_NVME = {**_COMMON, "bf16": {"enabled": True}, "fp16": {"enabled": False}, "zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4,
                          "fast_init": False},
    "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                      "buffer_size": 1e8, "max_in_cpu": 1e9},
    "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto",
    "stage3_gather_fp16_weights_on_model_save": True},
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
            "overlap_events": True}}
# DeepSpeed-Chat's training config (dschat/utils/ds_utils.py get_train_ds_config), hybrid engine and
# TensorBoard off, in the old bfloat16 spelling.
DS_CHAT = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "zero_optimization": {"stage": 3, "overlap_comm": True, "offload_param": {"device": "none"},
                          "offload_optimizer": {"device": "none"}, "stage3_param_persistence_threshold": 1e4,
                          "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                          "memory_efficient_linear": False},
    "bfloat16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
    "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1, "release_inference_cache": False,
                      "pin_parameters": True, "tp_gather_partition_size": 8},
    "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                    "job_name": "step1_model_tensorboard"},
}
# DeepSpeedExamples-style training config: Adam with bias_correction, fp16, every optional block off.
EXAMPLES = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 100,
    "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01,
                                             "bias_correction": True}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "zero_optimization": {"stage": 2, "cpu_offload": True, "contiguous_gradients": True},
    "torch_autocast": {"enabled": False}, "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1,
                                                              "top_modules": 1, "detailed": True, "output_file": None},
    "wandb": {"enabled": False, "project": "x"}, "csv_monitor": {"enabled": False}, "comet": {"enabled": False},
    "comms_logger": {"enabled": False}, "data_efficiency": {"enabled": False, "data_sampling": {"enabled": False}},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                 "contiguous_memory_optimization": False, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
}


def test_hf_zero3_nvme_template():
    cfg, warned = from_deepspeed(HF_ZERO3_NVME)
    assert (cfg.stage, cfg.dtype, cfg.offload_optimizer, cfg.offload_params, cfg.nvme_path) == \
        (3, "bf16", "nvme", "nvme", "/local_nvme")
    assert (cfg.nvme_block_kib, cfg.max_live_params) == (256, None)  # aio.block_size is bytes; "auto": DeepSpeed's default
    assert translate(HF_ZERO3_NVME).gather_16bit
    assert len(warned) == 1 and warned_keys(warned[0]) == {
        "steps_per_print", "wall_clock_breakdown", "zero_optimization.contiguous_gradients",
        "zero_optimization.sub_group_size", "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.buffer_size", "zero_optimization.offload_param.max_in_cpu",
        "aio.queue_depth", "aio.thread_count", "aio.single_submit", "aio.overlap_events"}


def test_deepspeed_chat_config():
    cfg, warned = from_deepspeed(DS_CHAT)
    assert (cfg.stage, cfg.dtype, cfg.param_persistence_threshold, cfg.max_live_params) == (3, "bf16", 10000, 30000000)
    assert cfg.overlap_grad_reduce and cfg.offload_params == "none"
    # Disabled hybrid engine and TensorBoard are not mentioned: DeepSpeed does nothing with them either.
    assert warned_keys(warned[0]) == {"steps_per_print", "prescale_gradients", "wall_clock_breakdown",
                                      "zero_optimization.memory_efficient_linear"}


def test_deepspeed_examples_config():
    cfg, warned = from_deepspeed(EXAMPLES)
    assert (cfg.stage, cfg.optimizer, cfg.betas, cfg.dtype, cfg.offload_optimizer) == \
        (2, "adamw", (0.9, 0.98), "fp16", "cpu")  # cpu_offload: true is offload_optimizer.device='cpu'
    assert warned_keys(warned[0]) == {"steps_per_print", "zero_optimization.contiguous_gradients"} | {
        f"activation_checkpointing.{k}" for k in EXAMPLES["activation_checkpointing"]}




@pytest.mark.parametrize("old,new", [
    ({"bfloat16": {"enabled": True}}, {"bf16": {"enabled": True}}),
    ({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
     {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}),
    ({"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True}},
     {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}),
    ({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 5e7, "param_persistence_threshold": 1e5,
                            "max_live_parameters": 1e9, "max_reuse_distance": 1e9, "model_persistence_threshold": 9,
                            "module_granularity_threshold": 0, "use_all_reduce_for_fetch_params": False,
                            "allgather_sequential": False}},
     {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                            "stage3_model_persistence_threshold": 9, "stage3_module_granularity_threshold": 0,
                            "stage3_use_all_reduce_for_fetch_params": False, "stage3_allgather_sequential": False}}),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True}},
     {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    ({"zero_optimization": {"stage": 3, "cpu_offload_param": True, "cpu_offload": False}},
     {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
    ({"zero_optimization": True, "allgather_size": 1e6}, {"zero_optimization": {"stage": 1, "allgather_bucket_size": 1e6}}),
    ({"zero_optimization": False}, {"zero_optimization": {"stage": 0}}),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "bias_correction": True}}},
     {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}),
])
def test_old_and_new_spellings_give_equal_configs(old, new):
    (cfg, warned), (cfg_new, warned_new) = from_deepspeed(old), from_deepspeed(new)
    assert cfg == cfg_new
    assert translate(old).gather_16bit == translate(new).gather_16bit
    # The warning names the keys as each document spells them.
    assert {k.replace("stage3_", "") for k in (warned_keys(warned[0]) if warned else ())} == \
        {k.replace("stage3_", "") for k in (warned_keys(warned_new[0]) if warned_new else ())}


def test_errors_name_keys_as_the_document_spells_them():
    with pytest.raises(ConfigError, match=r"^bfloat16.enabled='x' is not a bool"):
        config_from({"bfloat16": {"enabled": "x"}})
    with pytest.raises(ConfigError, match=r"^unsupported DeepSpeed config keys: bfloat16.xx$"):
        config_from({"bfloat16": {"enabled": True, "xx": 1}})
    with pytest.raises(ConfigError, match=r"^zero_optimization.max_live_parameters=-1 is not an int"):
        config_from({"zero_optimization": {"stage": 3, "max_live_parameters": -1}})
    _, warned = from_deepspeed({"zero_optimization": {"stage": 2, "prefetch_bucket_size": 10}})
    assert warned_keys(warned[0]) == {"zero_optimization.prefetch_bucket_size"}
    # DeepSpeed's lean setting: nothing live beyond the unit computing.
    assert config_from({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0}}).max_live_params == 1


def test_old_spellings_details():
    cfg, _ = from_deepspeed({"zero_optimization": {"stage": 3, "max_live_parameters": 1e7}})
    assert cfg.max_live_params == 10**7
    # DeepSpeed reads bfloat16 only without bf16: beside bf16 it is named among the keys without effect.
    cfg, warned = from_deepspeed({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}})
    assert cfg.dtype == "fp32" and warned_keys(warned[0]) == {"bfloat16"}
    with pytest.raises(ConfigError, match=r"zero_optimization.max_live_parameters=5 and "
                                          r"zero_optimization.stage3_max_live_parameters=6 are two spellings"):
        config_from({"zero_optimization": {"stage": 3, "max_live_parameters": 5, "stage3_max_live_parameters": 6}})
    with pytest.raises(ConfigError, match=r"cpu_offload_param and zero_optimization.offload_param are both given"):
        config_from({"zero_optimization": {"stage": 3, "cpu_offload_param": False, "offload_param": {"device": "cpu"}}})
    _, warned = from_deepspeed({"zero_optimization": {"stage": 1}, "allgather_size": 10})
    assert warned_keys(warned[0]) == {"allgather_size"}  # read only with "zero_optimization": true


@pytest.mark.parametrize("aio,fields,no_effect", [
    ({"block_size": 1048576, "intra_op_parallelism": 8}, {"nvme_block_kib": 1024, "nvme_threads": 8}, set()),
    ({"block_size": 1000000, "intra_op_parallelism": 100}, {}, {"aio.block_size", "aio.intra_op_parallelism"}),
    ({"block_size": 2**30, "use_gds": False}, {}, {"aio.block_size", "aio.use_gds"}),
])
def test_aio_maps_onto_swap_settings(aio, fields, no_effect):
    doc = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}, "aio": aio}
    cfg, warned = from_deepspeed(doc)
    for name, default in dataclasses.asdict(ZeroConfig()).items():
        if name in ("nvme_block_kib", "nvme_threads"):
            assert getattr(cfg, name) == fields.get(name, default)
    assert (warned_keys(warned[0]) if warned else set()) == no_effect


@pytest.mark.parametrize("doc,match", [
    ({"aio": {"block_size": "auto"}}, r"aio.block_size='auto'"),
    ({"aio": {"intra_op_parallelism": 0}}, r"aio.intra_op_parallelism=0"),
    ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}}, r"offload_optimizer.ratio=1.5"),
    ({"tensorboard": {"enabled": "yes"}}, r"tensorboard.enabled='yes'"),
    ({"tensorboard": {"enabled": False, "path": "x"}}, r"unsupported DeepSpeed config keys: tensorboard.path"),
])
def test_tuning_keys_are_checked(doc, match):
    with pytest.raises(ConfigError, match=match):
        config_from(doc)


def test_enabled_monitors_are_named_in_the_warning():
    doc = {"zero_optimization": {"stage": 1}, "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "j"},
           "wandb": {"enabled": True, "project": "p"}, "csv_monitor": {"enabled": True}, "comet": {"enabled": False},
           "flops_profiler": {"enabled": True, "profile_step": 2}, "comms_logger": {"enabled": True, "verbose": False}}
    _, warned = from_deepspeed(doc)
    assert warned_keys(warned[0]) == {"tensorboard", "wandb", "csv_monitor", "flops_profiler", "comms_logger"}


@pytest.mark.parametrize("doc,match", [
    ({"bf16": {"enabled": True, "check_grad_overflow": False}}, r"bf16.check_grad_overflow=False is not supported"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, r"fp32 master weights"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, r"optimizer state in fp32"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "bias_correction": True}}},
     r"optimizer.params.bias_correction do\(es\) not apply to optimizer.type='SGD'"),
])
def test_values_zerompi_cannot_compute_are_refused(doc, match):
    with pytest.raises(ConfigError, match=match):
        config_from(doc)


# Each feature zerompi lacks, as DeepSpeedExamples and DeepSpeed's docs enable it, and what the refusal names.
FEATURES = [
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False,
                                                     "comm_backend_name": "nccl"}}},
     "optimizer.type='OneBitAdam' (1-bit Adam: compressed optimizer communication zerompi does not implement; "
     "DeepSpeed 0.19.8 has removed it too)"),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "bias_correction": False, "var_freeze_step": 1000,
                                                      "var_update_scaler": 16, "local_step_scaler": 1000,
                                                      "local_step_clipper": 16, "cuda_aware": False,
                                                      "comm_backend_name": "nccl"}}},
     "optimizer.type='ZeroOneAdam' (0/1 Adam: "),
    ({"optimizer": {"type": "OneBitLamb", "params": {"lr": 11e-3, "max_coeff": 0.3, "min_coeff": 0.01,
                                                     "freeze_step": 1000, "coeff_beta": 0.9, "factor_max": 4.0,
                                                     "factor_min": 0.5, "factor_threshold": 0.1}}},
     "optimizer.type='OneBitLamb' (1-bit LAMB: "),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True, "quantizer_kernel": False},
                                                       "different_groups": {}}}},
     "compression_training.weight_quantization.shared_parameters.enabled=True (compression training: "),
    ({"data_efficiency": {"enabled": True, "seed": 1234, "data_sampling": {"enabled": True}}},
     "data_efficiency.data_sampling.enabled=True (data sampling: "),
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}},
     "curriculum_learning.enabled=True (curriculum learning: "),
    ({"autotuning": {"enabled": True, "arg_mappings": {}}}, "autotuning.enabled=True (autotuning: "),
    ({"tensor_parallel": {"autotp_size": 4}}, "tensor_parallel.autotp_size=4 (tensor parallelism: "),
    ({"pipeline": {"stages": "auto", "partition": "best"}}, "pipeline (pipeline parallelism: zerompi is data parallel"),
    ({"sparse_attention": {"mode": "fixed", "block": 16}}, "sparse_attention (sparse attention: "),
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001}}, "progressive_layer_drop.enabled=True"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 2000}}, "elasticity.enabled=True (elastic training: "),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine.enabled=True (hybrid engine: "),
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast.enabled=True (torch autocast: "),
]


@pytest.mark.parametrize("doc,reason", FEATURES, ids=[next(iter(d)) if "optimizer" not in d else d["optimizer"]["type"]
                                                      for d, _ in FEATURES])
def test_each_missing_feature_is_refused_with_its_reason(doc, reason):
    with pytest.raises(ConfigError, match=r"^DeepSpeed features zerompi does not implement: ") as err:
        config_from(doc)
    assert reason in str(err.value)
    assert "unsupported" not in str(err.value)  # the feature's own keys are its, not unknown


def test_missing_features_and_unknown_keys_in_one_error():
    doc = {"zero_optimization": {"stage": 2, "zenflow_x": 1}, "foo": 1}
    for feature, _ in FEATURES:
        doc.update({k: v for k, v in feature.items() if k != "optimizer"})
    doc["optimizer"] = FEATURES[0][0]["optimizer"]
    with pytest.raises(ConfigError) as err:
        config_from(doc)
    text = str(err.value)
    for _, reason in FEATURES[:1] + FEATURES[3:]:
        assert reason in text
    assert text.endswith("; unsupported DeepSpeed config keys: foo, zero_optimization.zenflow_x")


# DeepSpeed 0.19.8 refuses the removed features' blocks even disabled; configs written for earlier versions carry
# them, and a disabled block changes nothing, so zerompi accepts them.
@pytest.mark.parametrize("name", ["compression_training", "data_efficiency", "curriculum_learning", "autotuning",
                                  "progressive_layer_drop", "elasticity", "hybrid_engine", "torch_autocast",
                                  "pipeline", "sparse_attention", "tensor_parallel", "eigenvalue", "quantize_training"])
def test_disabled_features_are_accepted_silently(name):
    base = {"zero_optimization": {"stage": 2}}
    cfg, warned = from_deepspeed({**base, name: {"enabled": False, "anything": 1}})
    assert cfg == config_from(base) and warned == []


def test_disabled_by_default_and_tensor_parallel_off():
    base = {"zero_optimization": {"stage": 2}}
    for doc in ({"data_efficiency": {"data_sampling": {"enabled": False}}}, {"curriculum_learning": {}},
                {"compression_training": {"sparse_pruning": {"shared_parameters": {"enabled": False}}}},
                {"tensor_parallel": {"autotp_size": 1, "tp": {"tp_size": 1}}}):
        assert from_deepspeed({**base, **doc}) == (config_from(base), [])


@pytest.mark.parametrize("block,named", [
    ({"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": {"enabled": True}},
      "data_routing": {"enabled": True, "random_ltd": {"enabled": True}}},
     ["data_sampling.curriculum_learning.enabled=True (curriculum learning: ",
      "data_routing.random_ltd.enabled=True (random layerwise token dropping: "]),
    ({"enabled": True, "data_sampling": {"enabled": True, "dynamic_batching": {"enabled": True},
                                         "curriculum_learning": {"enabled": True}}},
     ["data_sampling.curriculum_learning.enabled=True (curriculum learning: ",
      "data_sampling.dynamic_batching.enabled=True (dynamic batching: "]),
])
def test_each_data_efficiency_technique_is_refused_by_name(block, named):
    with pytest.raises(ConfigError) as err:
        config_from({"data_efficiency": block})
    text = str(err.value)
    assert all(f"data_efficiency.{n}" in text for n in named), text
    assert "data_efficiency.data_sampling.enabled=True" not in text  # the gate is named by what it lets run


@pytest.mark.parametrize("block", [
    {"enabled": True, "seed": 1234},  # on, with no technique: nothing changes
    {"enabled": False, "data_sampling": {"enabled": True, "curriculum_learning": {"enabled": True}}},
    {"data_sampling": {"enabled": True, "curriculum_learning": {"enabled": True}}},  # its switch is off by default
    {"enabled": True, "data_sampling": {"enabled": False, "curriculum_learning": {"enabled": True}}},
])
def test_data_efficiency_that_runs_no_technique_is_accepted(block):
    base = {"zero_optimization": {"stage": 2}}
    assert from_deepspeed({**base, "data_efficiency": block}) == (config_from(base), [])


def test_auto_in_deepspeed_default_blocks_is_the_key_left_out():
    doc = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto", "allgather_bucket_size": "auto",
                                 "overlap_comm": "auto", "offload_param": {"device": "cpu", "pin_memory": "auto"}},
           "bf16": {"enabled": True, "immediate_grad_update": "auto"}, "tensorboard": {"enabled": "auto"}}
    cfg, warned = from_deepspeed(doc)
    assert cfg == config_from({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                               "bf16": {"enabled": True}})
    assert warned == []


# ---- DeepSpeed's own DeepSpeedConfig reads the same configs ------------------------------------

_DEEPSPEED_READS = """
import json, sys
from deepspeed.runtime.config import DeepSpeedConfig
out = []
for doc in json.load(sys.stdin):
    try:
        DeepSpeedConfig(doc)
        out.append(None)
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
print(json.dumps(out))
"""


def _without_auto(doc):
    """What Hugging Face's Trainer hands DeepSpeed: every "auto" filled (batch sizes 8 and 1, the rest left to
    DeepSpeed's defaults as its models drop "auto")."""
    fills = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    out = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out[k] = _without_auto(v)
        elif v == "auto":
            if k in fills:
                out[k] = fills[k]
            elif k in ("lr", "eps", "weight_decay", "warmup_min_lr", "warmup_max_lr", "gradient_clipping"):
                out[k] = 0.001
            elif k == "betas":
                out[k] = [0.9, 0.999]
            elif k == "warmup_num_steps":
                out[k] = 10
            elif k == "enabled":
                out[k] = False
            else:
                out[k] = v  # DeepSpeed's pydantic models drop it
        else:
            out[k] = v
    return out


def test_deepspeed_reads_the_accepted_configs():
    import json
    import os
    import subprocess

    from tests.peers import deepspeed_python

    docs = [_without_auto(d) for d in (HF_ZERO2, HF_ZERO3, HF_ZERO3_NVME, DS_CHAT, EXAMPLES, CIFAR)]
    for doc in docs:
        from_deepspeed(doc)
    python = deepspeed_python()
    proc = subprocess.run([str(python), "-c", _DEEPSPEED_READS], input=json.dumps(docs), capture_output=True, text=True,
                          timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [None] * len(docs)


def test_checkpoint_block():
    from zerompi.errors import ConfigError
    off = {"tag_validation": "Fail", "load_universal": False, "use_node_local_storage": False,
           "parallel_write": {"pipeline_stage": False}}
    with pytest.warns(UserWarning, match="checkpoint.tag_validation"):
        assert config_from({"checkpoint": off}) == config_from({})
    for dotted, why in (("load_universal", "universal checkpoint"), ("use_node_local_storage", "one directory"),
                        ("parallel_write", "pipeline stages")):
        value = {"pipeline_stage": True} if dotted == "parallel_write" else True
        with pytest.raises(ConfigError, match=why):
            config_from({"checkpoint": {dotted: value}})
    with pytest.raises(ConfigError, match="checkpoint.tag_validationx"):
        config_from({"checkpoint": {"tag_validationx": "Warn"}})


def test_dtype_keys_accept_the_compute_dtype_only():
    """communication_data_type and data_types: the compute dtype (DeepSpeed's default, and what zerompi
    reduces and accumulates in) is accepted under any of DeepSpeed's names; another dtype is refused
    with the key and the reason; buffer_dtype as null or the compute dtype, keep_in_fp32_modules as null, "auto"
    or []."""
    from zerompi.errors import ConfigError
    bf16 = {"bf16": {"enabled": True}}
    for extra, base in (({"communication_data_type": "fp32"}, {}), ({"communication_data_type": None}, {}),
                        ({"communication_data_type": "BF16"}, bf16),
                        ({"data_types": {"grad_accum_dtype": "bfloat16", "param_dtype": "bf16",
                                         "buffer_dtype": None, "keep_in_fp32_modules": None}}, bf16),
                        ({"data_types": {"grad_accum_dtype": "fp32"}}, {}),
                        ({"data_types": {"keep_in_fp32_modules": "auto"}}, bf16),  # DeepSpeed's default
                        ({"data_types": {"keep_in_fp32_modules": []}}, {})):
        assert config_from({**base, **extra}) == config_from(base)
    for extra, base, key, why in (
            ({"communication_data_type": "fp32"}, bf16, "communication_data_type", "summed in fp32"),
            ({"communication_data_type": "bf16"}, {}, "communication_data_type", "compute dtype"),
            ({"data_types": {"grad_accum_dtype": "fp32"}}, bf16, "data_types.grad_accum_dtype", "micro-batches"),
            ({"data_types": {"param_dtype": "fp16"}}, bf16, "data_types.param_dtype", "asserts the same"),
            ({"data_types": {"buffer_dtype": "fp32"}}, bf16, "data_types.buffer_dtype", "allowed: 'bf16'"),
            ({"data_types": {"keep_in_fp32_modules": ["rotary"]}}, {}, "data_types.keep_in_fp32_modules", "upcasts"),
            ({"data_types": {"keep_in_fp32_modules": "AUTO"}}, {}, "data_types.keep_in_fp32_modules", "allowed"),
            ({"communication_data_type": "int8"}, {}, "communication_data_type", "not a dtype")):
        with pytest.raises(ConfigError, match=why) as err:
            config_from({**base, **extra})
        assert key in str(err.value)


def test_buffer_dtype_null_keeps_the_models_and_the_compute_dtype_casts():
    """DeepSpeed 0.19 casts parameters alone unless data_types.buffer_dtype is set: null (or absent) is zerompi's
    buffer_dtype='model', the compute dtype (any of its names) is 'compute'."""
    bf16 = {"bf16": {"enabled": True}}
    assert config_from(bf16).buffer_dtype == "model"
    assert config_from({**bf16, "data_types": {"buffer_dtype": None}}).buffer_dtype == "model"
    assert config_from({**bf16, "data_types": {"buffer_dtype": "torch.bfloat16"}}).buffer_dtype == "compute"
    assert config_from({"data_types": {"buffer_dtype": "fp32"}}).buffer_dtype == "compute"


def test_compile_block_off_is_accepted():
    from zerompi.errors import ConfigError
    with pytest.warns(UserWarning, match="compile.offload_activation"):
        assert config_from({"compile": {"deepcompile": False, "offload_activation": True}}) == config_from({})
    assert config_from({"compile": {}}) == config_from({})
    with pytest.raises(ConfigError, match="compile.deepcompile.*DeepCompile"):
        config_from({"compile": {"deepcompile": True}})
    with pytest.raises(ConfigError, match="compile.nonsense"):
        config_from({"compile": {"nonsense": 1}})


@pytest.mark.parametrize("stage", (2, 3))
def test_hf_bf16_templates_with_the_old_spellings(stage):
    """transformers' ds_config_zero{2,3}_bf16.json shapes: "bfloat16" (the old name of "bf16") and, at stage 3,
    stage3_gather_fp16_weights_on_model_save (the old name of ..._16bit_...); with bf16 filled in as the
    Trainer does, they run bf16."""
    base = HF_ZERO2 if stage == 2 else HF_ZERO3
    doc = {k: v for k, v in base.items() if k not in ("fp16", "bf16")}
    doc["bfloat16"] = {"enabled": True}
    zero = dict(base["zero_optimization"])
    if stage == 3:
        zero["stage3_gather_fp16_weights_on_model_save"] = zero.pop("stage3_gather_16bit_weights_on_model_save")
    doc["zero_optimization"] = zero
    cfg, _ = from_deepspeed(doc)
    assert int(cfg.stage) == stage and cfg.dtype.value == "bf16" and cfg.offload_optimizer.value == "cpu"


@pytest.mark.parametrize("name", ["reduce_bucket_size", "allgather_bucket_size"])
def test_zero_bucket_size_is_a_bucket_per_parameter(name):
    """0 (older zero3 templates): DeepSpeed reduces before every parameter, so each one has a bucket of its own;
    a one-element bucket gives that here. Negative sizes stay refused."""
    cfg = config_from({"zero_optimization": {"stage": 3, name: 0}})
    assert cfg.bucket_numel(4) == 1 and cfg.bucket_numel(2) == 2
    with pytest.raises(ConfigError, match=rf"zero_optimization.{name}=-1 is not a finite number >= 0"):
        config_from({"zero_optimization": {"stage": 3, name: -1}})
