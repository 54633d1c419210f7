"""Unit tests of zerompi.config: validation, dict/file round trips, DeepSpeed translation."""
from __future__ import annotations

import dataclasses
import json
import math
import pickle

import pytest
import torch

from zerompi.compat.deepspeed import config_from
from zerompi.config import ZeroConfig
from zerompi.errors import ConfigError


class Lion(torch.optim.SGD):
    """An importable Optimizer subclass defined outside torch, declared element-wise."""

    elementwise = True


# --- defaults and construction ---------------------------------------------

def test_defaults():
    cfg = ZeroConfig()
    assert (cfg.stage, cfg.optimizer, cfg.optimizer_kwargs) == (3, "adamw", {})
    assert (cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay, cfg.momentum) == (
        1e-3, (0.9, 0.999), 1e-8, 0.01, 0.0)
    assert (cfg.grad_accum_steps, cfg.clip_grad_norm, cfg.dtype) == (1, None, "fp32")
    assert (cfg.loss_scale, cfg.initial_scale_power, cfg.loss_scale_window) == (0.0, 16, 1000)
    assert (cfg.hysteresis, cfg.min_loss_scale, cfg.bucket_mb, cfg.seed) == (2, 1.0, 25.0, 0)
    assert (cfg.cpu_threads, cfg.device, cfg.cuda_aware_mpi) == (None, "auto", "auto")
    assert (cfg.offload_optimizer, cfg.offload_params, cfg.nvme_path, cfg.pin_memory) == (
        "none", "none", None, True)
    assert cfg.torch_dtype is torch.float32 and cfg.buffer_dtype == "compute"
    assert cfg.optimizer_class() is torch.optim.AdamW


def test_field_order_matches_spec():
    # Section by section (config/sections/), as fields(), to_dict and the first error reported go.
    names = [f.name for f in dataclasses.fields(ZeroConfig)]
    assert names == [
        "stage", "bucket_mb", "param_persistence_threshold", "max_live_params", "hierarchy", "ranks_per_node",
        "optimizer", "optimizer_kwargs", "lr", "betas", "eps", "weight_decay", "momentum", "clip_grad_norm",
        "nonfinite", "lr_schedule", "warmup_steps", "total_steps", "min_lr",
        "grad_accum_steps", "micro_batches", "reproducible",
        "dtype", "buffer_dtype", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
        "min_loss_scale",
        "seed", "cpu_threads", "device", "cuda_aware_mpi",
        "offload_optimizer", "offload_params", "nvme_path", "pin_memory", "nvme_block_kib", "nvme_threads",
        "nvme_buffers", "nvme_verify", "return_freed_memory",
        "overlap_grad_reduce", "optimizer_in_backward", "prefetch_units", "mpi_progress",
        "quantize_weights", "quantize_grads", "quant_block", "grad_error_feedback",
        "checkpoint_layout", "checkpoint_verify", "checkpoint_direct_io", "checkpoint_align_kib",
        "checkpoint_async_copy",
        "debug_collectives", "collective_timeout", "hang_floor", "hang_dir", "abort_on_exception",
        "fault_tolerance", "recovery_every", "recovery_source", "recovery_dir", "min_ranks"]


@pytest.mark.parametrize("key,value", [
    ("nonfinite", "ignore"), ("nonfinite", 1), ("debug_collectives", 1), ("debug_collectives", "yes"),
    ("collective_timeout", 0), ("collective_timeout", -1.0), ("collective_timeout", float("nan")),
    ("collective_timeout", "10"), ("abort_on_exception", None), ("hierarchy", "2d"),
    ("ranks_per_node", 0), ("ranks_per_node", 1.5), ("hang_floor", 0), ("hang_floor", -3.0),
    ("hang_floor", float("inf")), ("hang_floor", "30"), ("hang_dir", ""), ("hang_dir", 3)])
def test_reliability_fields_reject_bad_values(key, value):
    with pytest.raises(ConfigError, match=key):
        ZeroConfig(**{key: value})


def test_reliability_fields_accept_good_values():
    cfg = ZeroConfig(nonfinite="skip", debug_collectives=True, collective_timeout=30, abort_on_exception=False)
    assert cfg.collective_timeout == 30.0 and cfg.nonfinite == "skip"
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZeroConfig().stage = 1


def test_ints_given_to_float_fields_become_floats():
    cfg = ZeroConfig(lr=1, eps=1, weight_decay=0, bucket_mb=4, min_loss_scale=2, loss_scale=8)
    for name in ("lr", "eps", "weight_decay", "bucket_mb", "min_loss_scale", "loss_scale"):
        assert type(getattr(cfg, name)) is float, name


def test_list_betas_become_tuple():
    cfg = ZeroConfig(betas=[0.8, 0.95])
    assert cfg.betas == (0.8, 0.95) and isinstance(cfg.betas, tuple)


@pytest.mark.parametrize("value", [0, 0.0, None])
def test_clip_zero_or_none_disables(value):
    assert ZeroConfig(clip_grad_norm=value).clip_grad_norm is None


def test_clip_positive_kept():
    assert ZeroConfig(clip_grad_norm=1).clip_grad_norm == 1.0


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                        ("fp16", torch.float16)])
def test_torch_dtype(name, dtype):
    assert ZeroConfig(dtype=name).torch_dtype is dtype


def test_valid_edge_values():
    cfg = ZeroConfig(stage=0, betas=(0.0, 0.0), initial_scale_power=64, cpu_threads=1,
                     seed=2**40, device="cuda", cuda_aware_mpi="off", nvme_path="/tmp/x",
                     pin_memory=False, optimizer_kwargs={"foreach": False})
    assert cfg.initial_scale_power == 64 and cfg.optimizer_kwargs == {"foreach": False}


def test_optimizer_kwargs_copied():
    kwargs = {"foreach": False}
    cfg = ZeroConfig(optimizer_kwargs=kwargs)
    kwargs["maximize"] = True
    assert cfg.optimizer_kwargs == {"foreach": False}


@pytest.mark.parametrize("optimizer,key", [
    ("adamw", "betas"), ("adam", "weight_decay"), ("adamw", "eps"), ("sgd", "momentum"),
    ("sgd", "lr"), (torch.optim.Adagrad, "lr"), ("torch.optim.Adagrad", "params"),
])
def test_optimizer_kwargs_may_not_repeat_fields(optimizer, key):
    with pytest.raises(ConfigError) as err:
        ZeroConfig(optimizer=optimizer, optimizer_kwargs={key: 0.5})
    assert str(err.value).startswith("optimizer_kwargs=") and repr(key) in str(err.value)


def test_optimizer_kwargs_for_other_optimizers():
    # weight_decay etc. are only fields of the named optimizers; others take them here.
    cfg = ZeroConfig(optimizer=torch.optim.Adagrad, optimizer_kwargs={"weight_decay": 0.1})
    assert cfg.optimizer_kwargs == {"weight_decay": 0.1}
    assert ZeroConfig(optimizer="sgd", optimizer_kwargs={"nesterov": True}).optimizer_kwargs


def test_bucket_numel():
    assert ZeroConfig(bucket_mb=25).bucket_numel(4) == 25 * 2**20 // 4
    assert ZeroConfig(bucket_mb=1).bucket_numel(2) == 2**19
    assert ZeroConfig(bucket_mb=1e-9).bucket_numel(8) == 1
    with pytest.raises(ValueError):
        ZeroConfig().bucket_numel(0)


# --- invalid values ----------------------------------------------------------

NAN, INF = math.nan, math.inf

BAD_VALUES = [
    ("stage", [-1, 4, True, 2.0, "3", None]),
    ("optimizer", ["lamb", "AdamW", "", 3, None, torch.optim.Optimizer, int, torch.nn.Linear]),
    ("optimizer_kwargs", [None, [("a", 1)], {1: 2}, {"lr": 0.1}, {"params": []}]),
    ("lr", [0, -1e-3, NAN, INF, True, "0.1", None]),
    ("betas", [(0.9,), (0.9, 0.99, 0.999), (0.9, 1.0), (-0.1, 0.9), (NAN, 0.9), 0.9,
               "ab", (True, 0.9)]),
    ("eps", [0, -1.0, NAN, INF, False]),
    ("weight_decay", [-0.1, NAN, INF, None, True]),
    ("momentum", [-0.5, NAN, "0.9"]),
    ("grad_accum_steps", [0, -2, 1.0, True, None]),
    ("clip_grad_norm", [-1.0, NAN, INF, True, "1"]),
    ("dtype", ["fp8", "float32", "FP16", torch.float32, None]),
    ("loss_scale", [-1, NAN, INF, True]),
    ("initial_scale_power", [-1, 65, 16.0, True]),
    ("loss_scale_window", [0, 10.5, False]),
    ("hysteresis", [0, -1, True]),
    ("min_loss_scale", [0, -1.0, NAN, INF]),
    ("bucket_mb", [0, -25, NAN, INF, True, "25"]),
    ("seed", [-1, 1.5, True, None]),
    ("cpu_threads", [0, -1, 2.0, True, "4"]),
    ("device", ["gpu", "CUDA", "", None]),
    ("cuda_aware_mpi", ["yes", True, None]),
    ("offload_optimizer", ["gpu", None]),
    ("offload_params", ["disk", False]),
    ("nvme_block_kib", [0, 6, 1 << 20, 4.0]),
    ("nvme_threads", [0, 65, True]),
    ("nvme_buffers", [0, 2000]),
    ("nvme_verify", ["yes"]),
    ("overlap_grad_reduce", [1, "true"]),
    ("optimizer_in_backward", [1, "true", None]),
    ("prefetch_units", [-1, 9, 1.0]),
    ("mpi_progress", ["threads", None]),
    ("nvme_path", ["", 3]),
    ("pin_memory", [1, "true", None]),
    ("quantize_weights", ["int4", "INT8", 8, None, True]),
    ("quantize_grads", ["int2", "fp8", 4, None]),
    ("quant_block", [0, 1, 3, 255, 65538, 256.0, True, "256", None]),
    ("grad_error_feedback", [1, "true", None]),
    ("reproducible", [1, "true", None]),
    ("micro_batches", [0, -1, 1.5, "4", True]),
    ("checkpoint_verify", [1, "yes", None]),
    ("checkpoint_direct_io", [0, "no", None]),
    ("return_freed_memory", [1, "yes", None]),
    ("checkpoint_align_kib", [0, 2, 6, 1000, 1 << 21, 4.0, True]),
    ("checkpoint_async_copy", [0, "no"]),
    ("recovery_source", ["ram", "Memory", 1, None]),
]


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in BAD_VALUES for v in vs],
                         ids=lambda x: repr(x)[:30])
def test_invalid_value_names_key_and_value(key, value):
    with pytest.raises(ConfigError) as err:
        ZeroConfig(**{key: value})
    msg = str(err.value)
    assert msg.startswith(key), msg
    # The received value is shown (containers by their repr, NaN as nan).
    shown = "nan" if isinstance(value, float) and math.isnan(value) else repr(value)
    if not isinstance(value, (tuple, list, dict)):
        assert shown in msg, msg


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in BAD_VALUES for v in vs],
                         ids=lambda x: repr(x)[:30])
def test_invalid_value_via_from_dict_is_config_error(key, value):
    with pytest.raises(ConfigError, match=key):
        ZeroConfig.from_dict({key: value})


def test_config_error_is_value_error():
    with pytest.raises(ValueError):
        ZeroConfig(stage=7)


def test_messages_list_allowed_values():
    with pytest.raises(ConfigError) as err:
        ZeroConfig(dtype="fp8")
    assert str(err.value) == "dtype='fp8' is not one of 'fp32', 'bf16', 'fp16'"
    with pytest.raises(ConfigError, match=r"stage=5 is not an int in 0\.\.3"):
        ZeroConfig(stage=5)
    with pytest.raises(ConfigError, match=r"lr=0 is not a finite number > 0"):
        ZeroConfig(lr=0)
    with pytest.raises(ConfigError, match=r"betas\[1\]=1\.0 .*>= 0 and < 1"):
        ZeroConfig(betas=(0.9, 1.0))


@pytest.mark.parametrize("kwargs,words", [
    (dict(stage=0, offload_optimizer="cpu"), ["offload_optimizer='cpu'", "stage=0"]),
    (dict(stage=2, offload_params="cpu"), ["offload_params='cpu'", "stage=2"]),
    (dict(stage=3, offload_optimizer="nvme"), ["nvme_path=None"]),
    (dict(stage=3, offload_params="nvme"), ["nvme_path=None"])])
def test_offload_cross_field_rules(kwargs, words):
    with pytest.raises(ConfigError) as err:
        ZeroConfig(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("kwargs,words", [
    (dict(stage=0, quantize_weights="int8"), ["quantize_weights='int8'", "stage=0", "allowed"]),
    (dict(stage=0, quantize_grads="int4"), ["quantize_grads='int4'", "stage=0"]),
    (dict(stage=3, grad_error_feedback=True), ["grad_error_feedback=True", "quantize_grads='none'"])])
def test_quantization_cross_field_rules(kwargs, words):
    with pytest.raises(ConfigError) as err:
        ZeroConfig(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("kwargs,words", [
    (dict(stage=1), ["optimizer_in_backward=True", "stage=1", "allowed: stage 2 or 3"]),
    (dict(stage=0), ["optimizer_in_backward=True", "stage=0", "allowed"]),
    (dict(stage=3, clip_grad_norm=1.0), ["optimizer_in_backward=True", "clip_grad_norm=1.0", "allowed: None"]),
    (dict(stage=2, dtype="fp16"), ["optimizer_in_backward=True", "dtype='fp16'", "allowed: 'fp32' or 'bf16'"]),
    (dict(stage=3, nonfinite="skip"), ["optimizer_in_backward=True", "nonfinite='skip'", "allowed: 'raise'"])])
def test_in_backward_cross_field_rules(kwargs, words):
    with pytest.raises(ConfigError) as err:
        ZeroConfig(optimizer_in_backward=True, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("kwargs", [dict(stage=2), dict(stage=3, dtype="bf16", clip_grad_norm=0),
                                    dict(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path="/tmp")])
def test_in_backward_accepted(kwargs):
    assert ZeroConfig(optimizer_in_backward=True, **kwargs).optimizer_in_backward is True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_quantization_accepted(stage):
    cfg = ZeroConfig(stage=stage, quantize_weights="int8", quantize_grads="int4", quant_block=64,
                     grad_error_feedback=True)
    policy = cfg.compression
    assert (policy.weights.bits, policy.grads.bits, policy.block, policy.error_feedback) == (8, 4, 64, True)
    assert policy.active and not ZeroConfig().compression.active
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg and cfg.to_dict()["quantize_grads"] == "int4"


def test_offload_accepted():
    cfg = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path="/tmp")
    assert (cfg.offload_optimizer, cfg.offload_params) == ("nvme", "cpu")


def test_first_problem_reported():
    with pytest.raises(ConfigError, match="^stage="):
        ZeroConfig(stage=9, lr=-1, dtype="x")
    with pytest.raises(ConfigError, match="^lr="):
        ZeroConfig(lr=-1, dtype="x")


# --- optimizer resolution ----------------------------------------------------

@pytest.mark.parametrize("name,cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam),
                                      ("sgd", torch.optim.SGD)])
def test_named_optimizers(name, cls):
    assert ZeroConfig(optimizer=name).optimizer_class() is cls


def test_optimizer_class_object():
    cfg = ZeroConfig(optimizer=torch.optim.RMSprop)
    assert cfg.optimizer is torch.optim.RMSprop
    assert cfg.optimizer_class() is torch.optim.RMSprop


def test_optimizer_dotted_path_kept_as_given():
    cfg = ZeroConfig(optimizer="torch.optim.Adagrad")
    assert cfg.optimizer == "torch.optim.Adagrad"
    assert cfg.optimizer_class() is torch.optim.Adagrad


def test_optimizer_dotted_path_to_test_class():
    cfg = ZeroConfig(optimizer=f"{__name__}.Lion")
    assert cfg.optimizer_class() is Lion


@pytest.mark.parametrize("path,why", [
    ("os.path", "not a subclass of torch.optim.Optimizer"),
    ("torch.nn.Linear", "not a subclass of torch.optim.Optimizer"),
    ("torch.optim.Optimizer", "not a subclass of torch.optim.Optimizer"),
    ("no_such_package_xyz.Opt", "cannot be imported"),
    ("torch.optim.NoSuchOptimizer", "cannot be imported"),
    ("torch.optim.", "cannot be imported"),
    (".relative.Opt", "cannot be imported"),
])
def test_optimizer_bad_dotted_path(path, why):
    with pytest.raises(ConfigError) as err:
        ZeroConfig(optimizer=path)
    assert str(err.value).startswith(f"optimizer={path!r}") and why in str(err.value)


# --- from_dict, to_dict, replace --------------------------------------------

def test_from_dict_values():
    cfg = ZeroConfig.from_dict({"stage": 1, "lr": 0.5, "betas": [0.5, 0.6], "dtype": "bf16"})
    assert (cfg.stage, cfg.lr, cfg.betas, cfg.dtype) == (1, 0.5, (0.5, 0.6), "bf16")
    assert cfg.seed == 0  # untouched fields keep defaults


def test_from_dict_unknown_keys_all_listed():
    with pytest.raises(ConfigError) as err:
        ZeroConfig.from_dict({"stage": 1, "zeta": 1, "alpha": 2, "learning_rate": 0.1})
    msg = str(err.value)
    assert "alpha, learning_rate, zeta" in msg  # sorted, all of them
    assert "stage" in msg and "pin_memory" in msg  # the allowed keys


@pytest.mark.parametrize("bad", [None, [("stage", 1)], "stage=1", 3])
def test_from_dict_non_mapping(bad):
    with pytest.raises(ConfigError):
        ZeroConfig.from_dict(bad)


@pytest.mark.parametrize("cfg", [
    ZeroConfig(),
    ZeroConfig(stage=1, optimizer="sgd", momentum=0.9, clip_grad_norm=2.0, dtype="fp16",
               loss_scale=128, cpu_threads=4, nvme_path="/scratch", pin_memory=False,
               optimizer_kwargs={"nesterov": True}),
    ZeroConfig(optimizer="torch.optim.Adagrad"),
    ZeroConfig(optimizer=torch.optim.Adagrad),
    ZeroConfig(optimizer=Lion),
])
def test_to_dict_round_trip(cfg):
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d  # plain JSON types only
    assert ZeroConfig.from_dict(d) == cfg
    assert ZeroConfig.from_dict(json.loads(json.dumps(d))) == cfg


def test_to_dict_shapes():
    d = ZeroConfig(optimizer=torch.optim.Adagrad, betas=(0.1, 0.2)).to_dict()
    assert d["optimizer"] == "torch.optim.adagrad.Adagrad"
    assert d["betas"] == [0.1, 0.2]
    assert list(d) == [f.name for f in dataclasses.fields(ZeroConfig)]


def test_equality_is_by_value():
    assert ZeroConfig(lr=0.1) == ZeroConfig(lr=0.1)
    assert ZeroConfig(lr=0.1) != ZeroConfig(lr=0.2)
    assert ZeroConfig(optimizer="adam") != ZeroConfig(optimizer="adamw")
    assert ZeroConfig(optimizer=torch.optim.Adagrad) == ZeroConfig(optimizer="torch.optim.Adagrad")
    assert ZeroConfig() != {"stage": 3}


def test_pickle_round_trip():
    cfg = ZeroConfig(stage=2, optimizer=torch.optim.Adagrad, betas=[0.8, 0.9])
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_replace():
    cfg = ZeroConfig().replace(stage=1, betas=[0.1, 0.2])
    assert cfg.stage == 1 and cfg.betas == (0.1, 0.2)
    with pytest.raises(ConfigError, match="stage=7"):
        cfg.replace(stage=7)
    with pytest.raises(ConfigError, match="bogus"):
        cfg.replace(bogus=1)


# --- from_file ---------------------------------------------------------------

TOML_FLAT = """
stage = 2
optimizer = "sgd"
lr = 0.05
momentum = 0.9
betas = [0.8, 0.9]
clip_grad_norm = 0
bucket_mb = 4
"""

TOML_JOB = """
[model]
name = "mlp"
layers = 4

[train]
steps = 100

[zero]
stage = 1
dtype = "bf16"
seed = 7
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_from_file_toml(tmp_path):
    cfg = ZeroConfig.from_file(_write(tmp_path, "c.toml", TOML_FLAT))
    assert (cfg.stage, cfg.optimizer, cfg.lr, cfg.momentum) == (2, "sgd", 0.05, 0.9)
    assert cfg.betas == (0.8, 0.9) and cfg.clip_grad_norm is None and cfg.bucket_mb == 4.0


def test_from_file_toml_table(tmp_path):
    path = _write(tmp_path, "job.toml", TOML_JOB)
    cfg = ZeroConfig.from_file(str(path), table="zero")
    assert (cfg.stage, cfg.dtype, cfg.seed) == (1, "bf16", 7)
    with pytest.raises(ConfigError, match="unknown config keys: layers, name"):
        ZeroConfig.from_file(path, table="model")
    with pytest.raises(ConfigError, match="unknown config keys: model, train, zero"):
        ZeroConfig.from_file(path)  # the whole job file is not a ZeroConfig


def test_from_file_missing_table(tmp_path):
    path = _write(tmp_path, "job.toml", TOML_JOB)
    with pytest.raises(ConfigError) as err:
        ZeroConfig.from_file(path, table="zeroo")
    assert "zeroo" in str(err.value) and "model, train, zero" in str(err.value)


def test_from_file_table_not_a_table(tmp_path):
    path = _write(tmp_path, "c.toml", 'zero = "x"\n')
    with pytest.raises(ConfigError, match="table='zero'"):
        ZeroConfig.from_file(path, table="zero")


def test_from_file_json(tmp_path):
    cfg = ZeroConfig(stage=1, optimizer=torch.optim.Adagrad, clip_grad_norm=3.0)
    path = _write(tmp_path, "c.JSON", json.dumps(cfg.to_dict()))
    assert ZeroConfig.from_file(path) == cfg
    path = _write(tmp_path, "job.json", json.dumps({"zero": {"stage": 0}, "model": {}}))
    assert ZeroConfig.from_file(path, table="zero").stage == 0


def test_from_file_error_names_file_and_key(tmp_path):
    path = _write(tmp_path, "c.toml", "stage = 5\n")
    with pytest.raises(ConfigError) as err:
        ZeroConfig.from_file(path)
    assert str(path) in str(err.value) and "stage=5" in str(err.value)


@pytest.mark.parametrize("name", ["c.yaml", "c.ini", "config", "c.toml.bak"])
def test_from_file_bad_extension(tmp_path, name):
    path = _write(tmp_path, name, "stage = 1\n")
    with pytest.raises(ConfigError, match="extension"):
        ZeroConfig.from_file(path)


@pytest.mark.parametrize("name,text", [("c.toml", "stage = = 1\n"), ("c.toml", "[zero\n"),
                                       ("c.json", '{"stage": 1,}'), ("c.json", "stage: 1")])
def test_from_file_unparsable(tmp_path, name, text):
    path = _write(tmp_path, name, text)
    with pytest.raises(ConfigError) as err:
        ZeroConfig.from_file(path)
    assert str(path) in str(err.value) and "is not valid" in str(err.value)


def test_from_file_json_not_object(tmp_path):
    with pytest.raises(ConfigError, match="holds a list"):
        ZeroConfig.from_file(_write(tmp_path, "c.json", "[1, 2]"))


def test_from_file_missing(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as err:
        ZeroConfig.from_file(path)
    assert str(path) in str(err.value) and "does not exist" in str(err.value)


def test_from_file_bad_path_type():
    with pytest.raises(ConfigError):
        ZeroConfig.from_file(42)


# --- from_deepspeed ----------------------------------------------------------

def full_deepspeed():
    """A realistic DeepSpeed config of the kind zerompi supports."""
    return {
        "train_batch_size": 256,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {
            "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 2,
            "contiguous_gradients": True,
            "overlap_comm": True,
            "reduce_scatter": True,
            "allgather_partitions": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 2e8,
            "offload_optimizer": {"device": "none", "pin_memory": True},
            "offload_param": {"device": "none"},
        },
    }


def test_from_deepspeed_full():
    cfg = config_from(full_deepspeed())
    assert cfg.stage == 2 and cfg.dtype == "bf16"
    assert cfg.optimizer == "adamw" and cfg.lr == 3e-4
    assert cfg.betas == (0.9, 0.95) and cfg.eps == 1e-6 and cfg.weight_decay == 0.1
    assert cfg.clip_grad_norm == 1.0 and cfg.grad_accum_steps == 4
    assert cfg.bucket_mb == pytest.approx(5e8 * 4 / 2**20)  # reduce wins over allgather
    assert cfg.offload_optimizer == cfg.offload_params == "none" and cfg.pin_memory is True
    # Fields DeepSpeed does not carry keep ZeroConfig's defaults.
    assert (cfg.seed, cfg.device, cfg.loss_scale) == (0, "auto", 0.0)


def test_from_deepspeed_is_a_deprecated_alias():
    doc = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    with pytest.warns(DeprecationWarning, match="zerompi.compat.deepspeed.config_from"):
        old = ZeroConfig.from_deepspeed(doc, lr=3e-4)
    assert old == config_from(doc, lr=3e-4)


def test_from_file_reads_the_registered_dialect(tmp_path):
    from zerompi.config import dialects
    assert dialects.named("DeepSpeed").recognises({"zero_optimization": {}})
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 3, "bogus": 1}}')
    with pytest.raises(ConfigError, match=r"read as a DeepSpeed config.*zero_optimization.bogus"):
        ZeroConfig.from_file(path)
    with pytest.raises(ConfigError, match="no config dialect 'Horovod'"):
        dialects.named("Horovod")


def test_from_deepspeed_defaults():
    cfg = config_from({})
    assert cfg.stage == 0  # DeepSpeed without zero_optimization is plain data parallel
    assert cfg.dtype == "fp32" and cfg.weight_decay == 0.01
    assert cfg.clip_grad_norm == 1.0  # DeepSpeed 0.19 clips at 1.0 unless gradient_clipping says otherwise


def test_from_deepspeed_allgather_bucket_alone():
    cfg = config_from({"zero_optimization": {"allgather_bucket_size": 2**20}})
    assert cfg.bucket_mb == 4.0


def test_from_deepspeed_gradient_clipping_zero():
    assert config_from({"gradient_clipping": 0.0}).clip_grad_norm is None


def test_from_deepspeed_fp16_block():
    cfg = config_from({"fp16": {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
        "hysteresis": 4, "min_loss_scale": 0.5, "auto_cast": False,
        "consecutive_hysteresis": False}})
    assert cfg.dtype == "fp16" and cfg.torch_dtype is torch.float16
    assert (cfg.loss_scale, cfg.initial_scale_power, cfg.loss_scale_window) == (0.0, 12, 500)
    assert (cfg.hysteresis, cfg.min_loss_scale) == (4, 0.5)
    static = config_from({"fp16": {"enabled": True, "loss_scale": 1024}})
    assert static.loss_scale == 1024.0


@pytest.mark.parametrize("flag", ["auto_cast", "consecutive_hysteresis"])
def test_from_deepspeed_fp16_unsupported_switches(flag):
    with pytest.raises(ConfigError, match=rf"fp16\.{flag}=True is not supported"):
        config_from({"fp16": {"enabled": True, flag: True}})


def test_from_deepspeed_bf16_and_fp16():
    with pytest.raises(ConfigError, match="bf16.enabled=True and fp16.enabled=True"):
        config_from({"bf16": {"enabled": True}, "fp16": {"enabled": True}})


def test_from_deepspeed_precision_blocks_disabled():
    cfg = config_from({"bf16": {"enabled": False}, "fp16": {}})
    assert cfg.dtype == "fp32"


@pytest.mark.parametrize("block,expected", [
    ({"type": "Adam"}, "adamw"),
    ({"type": "adam", "params": {"adam_w_mode": True}}, "adamw"),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, "adam"),
    ({"type": "ADAMW", "params": {"adam_w_mode": False}}, "adamw"),
    ({"type": "AdamW", "params": {"torch_adam": True}}, "adamw"),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "sgd"),
])
def test_from_deepspeed_optimizer_type(block, expected):
    cfg = config_from({"optimizer": block})
    assert cfg.optimizer == expected
    assert cfg.weight_decay == 0.0  # DeepSpeed's optimizers default to no weight decay


def test_from_deepspeed_sgd_params():
    cfg = config_from({"optimizer": {"type": "sgd", "params": {
        "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}}})
    assert (cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay) == ("sgd", 0.1, 0.9, 1e-4)


@pytest.mark.parametrize("block,match", [
    ({"type": "Lamb"}, r"optimizer.type='Lamb' is not one of 'Adam', 'AdamW', 'SGD'"),
    ({"params": {"lr": 0.1}}, r"optimizer.type=\(missing\)"),
    ({"type": 3}, r"optimizer.type=3"),
    ({"type": "SGD", "params": {"betas": [0.9, 0.9]}}, r"optimizer.params.betas"),
    ({"type": "Adam", "params": {"momentum": 0.9}}, r"optimizer.params.momentum"),
    ({"type": "Adam", "params": {"adam_w_mode": "no"}}, r"optimizer.params.adam_w_mode='no'"),
    ({"type": "Adam", "params": {"lr": "autox"}}, r"optimizer.params.lr='autox'"),
    ({"type": "Adam", "params": {"betas": [0.9, 1.5]}}, r"optimizer.params.betas\[1\]=1.5"),
    ({"type": "Adam", "params": 0.1}, r"optimizer.params=0.1"),
])
def test_from_deepspeed_optimizer_errors(block, match):
    with pytest.raises(ConfigError, match=match):
        config_from({"optimizer": block})


def test_from_deepspeed_unsupported_keys_in_one_error():
    d = full_deepspeed()
    d["scheduler"] = {"type": "WarmupLR", "params": {"warmup_steps": 3}}
    d["activation_checkpointing"] = {"partition_activations": True}  # accepted, no effect
    d["activation_checkpointing_v2"] = {}
    d["zero_optimization"]["stage3_prefetch_bucket_size"] = 5e7  # supported
    d["zero_optimization"]["offload_param"]["buffer_count"] = 4  # accepted, no effect
    d["zero_optimization"]["offload_param"]["buffer_counts"] = 4
    d["optimizer"]["params"]["foo"] = 1
    d["fp16"]["fp16_master_weights"] = False
    d["seed"] = 1  # not a DeepSpeed key
    with pytest.raises(ConfigError) as err:
        config_from(d)
    assert str(err.value) == (
        "unsupported DeepSpeed config keys: activation_checkpointing_v2, "
        "fp16.fp16_master_weights, optimizer.params.foo, scheduler.params.warmup_steps, seed, "
        "zero_optimization.offload_param.buffer_counts")


def test_from_deepspeed_dotted_top_level_keys_have_no_effect_as_in_deepspeed():
    """TRL's prepare_deepspeed writes "zero_optimization.reduce_bucket_size" and two more at the top level;
    DeepSpeed 0.19.8 reads nested keys only. Those naming a DeepSpeed key (an old spelling too) are accepted
    with no effect and named in the warning; a dotted name DeepSpeed lacks is refused as a top-level key."""
    dotted = {"zero_optimization.reduce_bucket_size": 4096, "zero_optimization.prefetch_bucket_size": 3686.4,
              "zero_optimization.stage3_param_persistence_threshold": {"not": "checked"},
              "bf16.enabled": True}  # a key of a block of leaves
    base = {"zero_optimization": {"stage": 3}}
    with pytest.warns(UserWarning) as caught:
        assert config_from({**base, **dotted}) == config_from(base)
    text = str(caught[-1].message)
    for key in dotted:
        assert f"{key!r} at the top level (DeepSpeed reads it nowhere)" in text, text
    with pytest.raises(ConfigError) as err:
        config_from({**base, "zero_optimization.stage3_prefetch_bucket": 1})
    assert str(err.value) == ("unsupported DeepSpeed config keys: 'zero_optimization.stage3_prefetch_bucket' "
                              "(a top-level key with dots in its name)")


@pytest.mark.parametrize("d,key", [
    ({"fp16": True}, "fp16=True"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled='yes'"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage='2'"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4"),
    ({"zero_optimization": 3}, "zero_optimization=3"),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size=-1"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm='yes'"),
    ({"zero_optimization": {"offload_optimizer": "cpu"}}, "zero_optimization.offload_optimizer="),
    ({"zero_optimization": {"offload_param": {"pin_memory": 1}}},
     "zero_optimization.offload_param.pin_memory=1"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
    ({"gradient_clipping": -1.0}, "gradient_clipping=-1.0"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis=0"),
    ({"optimizer": "adam"}, "optimizer='adam'"),
])
def test_from_deepspeed_wrong_types_name_dotted_key(d, key):
    with pytest.raises(ConfigError) as err:
        config_from(d)
    assert str(err.value).startswith(key), str(err.value)


@pytest.mark.parametrize("block,field", [("offload_optimizer", "offload_optimizer"),
                                         ("offload_param", "offload_params")])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_from_deepspeed_offload_blocks(block, field, device):
    d = {"zero_optimization": {"stage": 3, block: {"device": device, "pin_memory": True, "nvme_path": "/tmp"}}}
    assert getattr(config_from(d), field) == device


def test_from_deepspeed_offload_paths():
    d = {"zero_optimization": {
        "offload_optimizer": {"device": "none", "nvme_path": "/nvme", "pin_memory": False},
        "offload_param": {"device": "none", "nvme_path": "/nvme"}}}
    cfg = config_from(d)
    assert cfg.nvme_path == "/nvme" and cfg.pin_memory is False
    d["zero_optimization"]["offload_param"]["nvme_path"] = "/other"
    with pytest.raises(ConfigError, match="nvme_path"):
        config_from(d)


def test_from_deepspeed_overrides():
    cfg = config_from(full_deepspeed(), seed=1, stage=3, device="cpu")
    assert (cfg.seed, cfg.stage, cfg.device, cfg.dtype) == (1, 3, "cpu", "bf16")
    with pytest.raises(ConfigError, match="unknown DeepSpeed config overrides: sed"):
        config_from(full_deepspeed(), sed=1)
    with pytest.raises(ConfigError, match="^seed=-1"):
        config_from(full_deepspeed(), seed=-1)


@pytest.mark.parametrize("bad", [None, [], "{}"])
def test_from_deepspeed_non_mapping(bad):
    with pytest.raises(ConfigError):
        config_from(bad)


def test_from_file_detects_deepspeed_json(tmp_path):
    path = _write(tmp_path, "ds_config.json", json.dumps(full_deepspeed()))
    assert ZeroConfig.from_file(path) == config_from(full_deepspeed())


@pytest.mark.parametrize("doc", [{"train_batch_size": 8}, {"optimizer": {"type": "SGD"}},
                                 {"bf16": {"enabled": True}}])
def test_from_file_detects_deepspeed_markers(tmp_path, doc):
    cfg = ZeroConfig.from_file(_write(tmp_path, "ds.json", json.dumps(doc)))
    assert cfg.stage == 0  # translated, so DeepSpeed's default stage applies


def test_from_file_deepspeed_in_table(tmp_path):
    path = _write(tmp_path, "job.json", json.dumps({"model": {}, "zero": full_deepspeed()}))
    assert ZeroConfig.from_file(path, table="zero").grad_accum_steps == 4


def test_from_file_deepspeed_error_mentions_translation(tmp_path):
    d = full_deepspeed()
    d["scheduler"] = {"kind": "WarmupLR"}
    with pytest.raises(ConfigError) as err:
        ZeroConfig.from_file(_write(tmp_path, "ds.json", json.dumps(d)))
    assert "DeepSpeed" in str(err.value) and "scheduler" in str(err.value)


def test_an_unknown_keyword_or_a_positional_value_is_a_config_error_naming_it():
    """``ZeroConfig(stge=3)`` raised the dataclass's plain TypeError, naming neither the allowed keys nor the
    close match."""
    with pytest.raises(ConfigError, match=r"unknown config keys: stge \(did you mean stage\?\); allowed: stage, "):
        ZeroConfig(stge=3)
    with pytest.raises(ConfigError, match="keyword arguments only"):
        ZeroConfig(3)
    with pytest.raises(ConfigError, match=r"unknown config keys: lrr \(did you mean lr\?\)"):
        ZeroConfig(stage=1).replace(lrr=0.1)
