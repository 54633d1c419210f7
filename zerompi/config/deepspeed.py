"""Translation of DeepSpeed JSON configs into ZeroConfig fields.

Keys zerompi understands are mapped one by one; every other key is collected
and refused in one ConfigError, because silently dropping a setting changes
training.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from zerompi.config.checks import CHECKS, boolean, listing, real
from zerompi.config.choices import DType
from zerompi.errors import ConfigError


_DS_MARKERS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps", "fp16", "bf16")
_DS_OFFLOAD = ("device", "nvme_path", "pin_memory")
# Keys zerompi understands: None is a leaf, a tuple a block of leaves, a dict a
# block of blocks. Anything else is refused: dropping a setting changes training.
_DS_SCHEMA: dict[str, Any] = {
    "zero_optimization": {
        "stage": None, "reduce_bucket_size": None, "allgather_bucket_size": None,
        "offload_optimizer": _DS_OFFLOAD, "offload_param": _DS_OFFLOAD,
        "contiguous_gradients": None, "overlap_comm": None, "reduce_scatter": None,
        "allgather_partitions": None},
    "gradient_accumulation_steps": None, "gradient_clipping": None,
    "bf16": ("enabled",),
    "fp16": ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
             "hysteresis", "min_loss_scale", "auto_cast", "consecutive_hysteresis"),
    "optimizer": {"type": None, "params": ("lr", "betas", "eps", "weight_decay", "momentum",
                                           "adam_w_mode", "torch_adam")},
    # Data loader and logging settings, outside this config's scope.
    "train_batch_size": None, "train_micro_batch_size_per_gpu": None,
    "steps_per_print": None, "wall_clock_breakdown": None,
}
# DeepSpeed keys that carry one ZeroConfig field unchanged.
_DS_DIRECT = (
    ("zero_optimization.stage", "stage"),
    ("zero_optimization.offload_optimizer.device", "offload_optimizer"),
    ("zero_optimization.offload_param.device", "offload_params"),
    ("gradient_accumulation_steps", "grad_accum_steps"),
    ("gradient_clipping", "clip_grad_norm"),
    *((f"fp16.{k}", k) for k in ("loss_scale", "initial_scale_power", "loss_scale_window",
                                 "hysteresis", "min_loss_scale")),
    *((f"optimizer.params.{k}", k) for k in ("lr", "betas", "eps", "weight_decay", "momentum")),
)
# Switches for behaviour zerompi always has (or an implementation choice): any bool is fine.
_DS_IGNORED_BOOLS = ("optimizer.params.torch_adam", *(f"zero_optimization.{k}" for k in (
    "contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions")))
_DS_OPTIMIZERS = ("Adam", "AdamW", "SGD")
_DS_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam")
_DS_SGD_PARAMS = ("lr", "momentum", "weight_decay")


def looks_like_deepspeed(doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` is a DeepSpeed config rather than zerompi's own keys."""
    # zerompi's own "optimizer" is a string, so a dict there means DeepSpeed.
    return any(k in doc for k in _DS_MARKERS) or isinstance(doc.get("optimizer"), Mapping)


def _ds_walk(block: Mapping, schema: Any, prefix: str, unsupported: list[str]) -> None:
    """Collect keys missing from ``schema`` as dotted paths; refuse non-mapping blocks."""
    if isinstance(schema, tuple):
        schema = dict.fromkeys(schema)
    for key, value in block.items():
        dotted = f"{prefix}{key}"
        if key not in schema:
            unsupported.append(dotted)
        elif schema[key] is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{dotted}={value!r} is not an object with keys from: "
                                  + ", ".join(schema[key]))
            _ds_walk(value, schema[key], dotted + ".", unsupported)


def _ds_get(d: Mapping, dotted: str) -> tuple[bool, Any]:
    node: Any = d
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _ds_zero(d: Mapping, kwargs: dict[str, Any]) -> None:
    # Sizes are in elements; zerompi counts them as fp32 (4 bytes). reduce wins
    # over allgather because it sizes the gradient buckets bucket_mb describes.
    for name in ("allgather_bucket_size", "reduce_bucket_size"):
        found, value = _ds_get(d, f"zero_optimization.{name}")
        if found:
            key = f"zero_optimization.{name}"
            mb = real(key, value, gt=0) * 4 / 2**20
            if not (math.isfinite(mb) and mb > 0):  # representable as elements, not as MiB
                raise ConfigError(f"{key}={value!r} is not a bucket size zerompi can use "
                                  "(elements, > 0 and below about 1e300)")
            kwargs["bucket_mb"] = mb
    # zerompi has one nvme_path and one pin_memory for both offload blocks.
    for name in ("nvme_path", "pin_memory"):
        seen = {}
        for block in ("offload_optimizer", "offload_param"):
            dotted = f"zero_optimization.{block}.{name}"
            found, value = _ds_get(d, dotted)
            if found:
                seen[dotted] = kwargs[name] = CHECKS[name](dotted, value)
        if len(seen) == 2 and len(set(seen.values())) == 2:
            raise ConfigError(" and ".join(f"{k}={v!r}" for k, v in seen.items())
                              + f" differ; allowed: the same {name} in both blocks")


def _ds_flag(d: Mapping, dotted: str) -> bool:
    """The bool at ``dotted``, False when absent."""
    found, value = _ds_get(d, dotted)
    return found and boolean(dotted, value)


def _ds_precision(d: Mapping, kwargs: dict[str, Any]) -> None:
    bf16, fp16 = _ds_flag(d, "bf16.enabled"), _ds_flag(d, "fp16.enabled")
    if bf16 and fp16:
        raise ConfigError("bf16.enabled=True and fp16.enabled=True are both set; "
                          "allowed: at most one of them enabled")
    kwargs["dtype"] = DType.BF16 if bf16 else DType.FP16 if fp16 else DType.FP32
    for flag in ("fp16.auto_cast", "fp16.consecutive_hysteresis"):
        if _ds_flag(d, flag):
            raise ConfigError(f"{flag}=True is not supported; allowed: false")


def _ds_optimizer(d: Mapping, kwargs: dict[str, Any]) -> None:
    if "optimizer" not in d:
        return
    found, kind = _ds_get(d, "optimizer.type")
    if not isinstance(kind, str) or kind.lower() not in {t.lower() for t in _DS_OPTIMIZERS}:
        shown = repr(kind) if found else "(missing)"
        raise ConfigError(f"optimizer.type={shown} is not one of {listing(_DS_OPTIMIZERS)} "
                          "(case-insensitive)")
    kind = kind.lower()
    params = d["optimizer"].get("params", {})
    allowed = _DS_SGD_PARAMS if kind == "sgd" else _DS_ADAM_PARAMS
    wrong = sorted(f"optimizer.params.{k}" for k in params if k not in allowed)
    if wrong:
        raise ConfigError(f"{', '.join(wrong)} do(es) not apply to optimizer.type="
                          f"{d['optimizer']['type']!r}; allowed params: {', '.join(allowed)}")
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false,
    # and its "AdamW" does so whatever adam_w_mode says.
    w_mode = boolean("optimizer.params.adam_w_mode", params.get("adam_w_mode", True))
    adam = "adamw" if w_mode or kind == "adamw" else "adam"
    kwargs["optimizer"] = "sgd" if kind == "sgd" else adam
    # DeepSpeed's optimizers default to no weight decay; keep that meaning.
    kwargs["weight_decay"] = 0.0


def deepspeed_kwargs(d: Mapping[str, Any]) -> dict[str, Any]:
    """ZeroConfig keyword arguments for a DeepSpeed config (unsupported keys: one ConfigError)."""
    unsupported: list[str] = []
    _ds_walk(d, _DS_SCHEMA, "", unsupported)
    if unsupported:
        raise ConfigError("unsupported DeepSpeed config keys: " + ", ".join(sorted(unsupported)))
    for dotted in _DS_IGNORED_BOOLS:
        _ds_flag(d, dotted)
    kwargs: dict[str, Any] = {"stage": 0}
    _ds_zero(d, kwargs)
    _ds_precision(d, kwargs)
    _ds_optimizer(d, kwargs)
    for dotted, name in _DS_DIRECT:
        found, value = _ds_get(d, dotted)
        if found:
            kwargs[name] = CHECKS[name](dotted, value)
    return kwargs
