"""Translation of DeepSpeed JSON configs into ZeroConfig fields.

The document is screened first (screen.py): old spellings become the keys zerompi reads,
and features zerompi lacks and unknown keys are refused together in one ConfigError, because
silently dropping a setting changes training. ``"auto"`` values are resolved next (auto.py).
Keys zerompi understands (keys.py) are then mapped one by one, the offload and aio ones in
swap.py. Tuning and logging keys that cannot change the result (``overlap_comm`` aside, which
maps to overlap_grad_reduce) are accepted and named in :attr:`Translation.no_effect`, which
the caller reports in one warning.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any, NamedTuple

from torch import nn

from zerompi.optim import adam as uncorrected
from zerompi.config import ZeroConfig
from zerompi.config.checks import boolean, integer, listing, real, reject_unknown
from zerompi.config.choices import BufferDType, DType
from zerompi.config.declare import spellings
from zerompi.config.zero import CHECKS, SECTIONS
from zerompi.compat.deepspeed import muon as ds_muon
from zerompi.compat.deepspeed.auto import is_auto, resolve_auto
from zerompi.compat.deepspeed.batch import BatchKeys, read_batch_keys
from zerompi.compat.deepspeed.keys import (ADAM_PARAMS, COMPILE, COMPILE_OFF, COMPUTE_DTYPE_KEYS, DTYPES, MONITORS,
                                          KEEP_IN_FP32, NO_EFFECT, BUFFER_DTYPE, REQUIRED, SGD_PARAMS)
from zerompi.compat.deepspeed.schedule import DeepSpeedSchedule, read_schedule
from zerompi.compat.deepspeed.screen import get as _ds_get, respell, respelled, screen
from zerompi.compat.deepspeed.swap import read_swap, whole
from zerompi.errors import ConfigError


_DS_MARKERS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps", "fp16", "bf16", "bfloat16")
_DS_DIRECT = spellings(SECTIONS, "DeepSpeed")
"""DeepSpeed keys that carry one ZeroConfig key unchanged, as each key's declaration spells it (config/sections/)."""
# Honoured by zerompi.deepspeed's save_16bit_model (a stage-3 engine writes the gathered weights only
# when it is true, as DeepSpeed's does), not by the config: checked here, read there.
SAVE_16BIT = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
# Stage-3 sizes that map onto fields at stage 3 only; at other stages they have no effect.
_STAGE3_ONLY = ("zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
                "zero_optimization.stage3_max_live_parameters")
# ZeRO++ (stage 3 in DeepSpeed; no effect below it): qwZ's int8 weights, qgZ's int4 gradients, hpZ.
_ZEROPP = {"zero_optimization.zero_quantized_weights": "bool", "zero_optimization.zero_quantized_gradients": "bool",
           "zero_optimization.zero_hpz_partition_size": "size"}
_DS_OPTIMIZERS = ("Adam", "AdamW", "SGD")


def looks_like_deepspeed(doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` is a DeepSpeed config rather than zerompi's own keys."""
    # zerompi's own "optimizer" is a string, so a dict there means DeepSpeed.
    return any(k in doc for k in _DS_MARKERS) or isinstance(doc.get("optimizer"), Mapping)


def _ds_zero(d: Mapping, kwargs: dict[str, Any]) -> None:
    # Sizes are in elements; zerompi counts them as fp32 (4 bytes). reduce wins
    # over allgather because it sizes the gradient buckets bucket_mb describes.
    # 0 (older templates) is DeepSpeed's "flush before every parameter": one parameter
    # per bucket, which a one-element bucket_mb gives (a larger parameter fills its own).
    for name in ("allgather_bucket_size", "reduce_bucket_size"):
        found, value = _ds_get(d, f"zero_optimization.{name}")
        if found:
            key = f"zero_optimization.{name}"
            mb = max(real(key, value, ge=0), 1) * 4 / 2**20
            if not (math.isfinite(mb) and mb > 0):  # representable as elements, not as MiB
                raise ConfigError(f"{key}={value!r} is not a bucket size zerompi can use "
                                  "(elements, > 0 and below about 1e300)")
            kwargs["bucket_mb"] = mb


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
    for dotted, (allowed, why) in REQUIRED.items():
        found, value = _ds_get(d, dotted)
        if found and boolean(dotted, value) != allowed:
            raise ConfigError(f"{dotted}={value} is not supported: {why}; allowed: {str(allowed).lower()}")
    kwargs["buffer_dtype"] = _ds_dtypes(d, "bf16" if bf16 else "fp16" if fp16 else "fp32")


def _training(compute: str) -> str:
    """The compute dtype and the keys that chose it, for a message about a key that disagrees."""
    return f"{compute} training ({'bf16.enabled and fp16.enabled off' if compute == 'fp32' else compute + '.enabled'})"


def _ds_dtypes(d: Mapping, compute: str) -> BufferDType:
    """``communication_data_type`` and ``data_types``: each dtype must be the compute dtype (the
    buffers' may be null); ``compile.deepcompile`` must be false. Returns the buffers' dtype choice."""
    buffers = BufferDType.MODEL  # DeepSpeed 0.19 casts parameters alone: an fp32 rotary table stays fp32
    for dotted, why in [*COMPUTE_DTYPE_KEYS.items(), BUFFER_DTYPE]:
        found, value = _ds_get(d, dotted)
        if not found or value is None:
            continue
        named = DTYPES.get(value.lower()) if isinstance(value, str) else None
        if named is None:
            raise ConfigError(f"{dotted}={value!r} is not a dtype DeepSpeed reads; allowed: fp32, bf16, fp16")
        if named != compute:
            raise ConfigError(f"{dotted}={value!r} is not supported with {_training(compute)}: {why}; "
                              f"allowed: {compute!r} (or null)")
        if dotted == BUFFER_DTYPE[0]:
            buffers = BufferDType.COMPUTE
    dotted, allowed, why = KEEP_IN_FP32
    found, value = _ds_get(d, dotted)
    if found and value not in allowed:
        raise ConfigError(f"{dotted}={value!r} is not supported: {why}; allowed: \"auto\", [] or null")
    dotted, why = COMPILE_OFF
    found, value = _ds_get(d, dotted)
    if found and boolean(dotted, value):
        raise ConfigError(f"{dotted}={value} is not supported: {why}; allowed: false")
    return buffers


def _ds_optimizer(d: Mapping, kwargs: dict[str, Any]) -> ds_muon.MuonSettings | None:
    if "optimizer" not in d:
        return None
    found, kind = _ds_get(d, "optimizer.type")
    if ds_muon.is_muon(kind):
        return ds_muon.read(d["optimizer"].get("params", {}), kwargs)
    if not isinstance(kind, str) or kind.lower() not in {t.lower() for t in _DS_OPTIMIZERS}:
        shown = repr(kind) if found else "(missing)"
        raise ConfigError(f"optimizer.type={shown} is not one of {listing(_DS_OPTIMIZERS + ('Muon',))} "
                          "(case-insensitive)")
    kind = kind.lower()
    params = d["optimizer"].get("params", {})
    allowed = SGD_PARAMS if kind == "sgd" else ADAM_PARAMS
    wrong = sorted(f"optimizer.params.{k}" for k in params if k not in allowed)
    if wrong:
        raise ConfigError(f"{', '.join(wrong)} do(es) not apply to optimizer.type="
                          f"{d['optimizer']['type']!r}; allowed params: {', '.join(allowed)}")
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false,
    # and its "AdamW" does so whatever adam_w_mode says.
    w_mode = boolean("optimizer.params.adam_w_mode", params.get("adam_w_mode", True))
    adam = "adamw" if w_mode or kind == "adamw" else "adam"
    kwargs["optimizer"] = "sgd" if kind == "sgd" else adam
    if kind != "sgd" and not boolean("optimizer.params.bias_correction", params.get("bias_correction", True)):
        kwargs["optimizer"] = uncorrected.PATH  # the moments as they are, as DeepSpeed's kernels allow
        if adam == "adam":
            kwargs["optimizer_kwargs"] = {"decoupled": False}
    # DeepSpeed's optimizers default to no weight decay; keep that meaning.
    kwargs["weight_decay"] = 0.0
    return None


def _ds_no_effect(d: Mapping, stage3: bool) -> list[str]:
    """The tuning keys present in ``d`` (type-checked), and stage-3 sizes below stage 3."""
    present = []
    for dotted, kind in NO_EFFECT.items():
        found, value = _ds_get(d, dotted)
        if found:
            if kind == "bool":
                boolean(dotted, value)
            elif kind != "any" and not is_auto(value):
                if kind == "ratio":
                    _ratio(dotted, value)
                elif not (kind == "interval" and value == math.inf):
                    real(dotted, value, ge=0)
            present.append(dotted)
    present += [f"compile.{k}" for k in COMPILE if k != "deepcompile" and _ds_get(d, f"compile.{k}")[0]]
    for name in MONITORS:
        found, value = _ds_get(d, f"{name}.enabled")
        if found and boolean(f"{name}.enabled", value):
            present.append(name)
    found, value = _ds_get(d, SAVE_16BIT)
    if found:
        boolean(SAVE_16BIT, value)
    for dotted in _STAGE3_ONLY:
        found, value = _ds_get(d, dotted)
        if found and not stage3:
            real(dotted, value, ge=0)
            present.append(dotted)
    for dotted, kind in _ZEROPP.items():
        found, value = _ds_get(d, dotted)
        if found and not stage3:
            boolean(dotted, value) if kind == "bool" else _hpz_size(d)
            present.append(dotted)
    return present


def _ratio(dotted: str, value: Any) -> float:
    ratio = real(dotted, value, ge=0)
    if ratio > 1:
        raise ConfigError(f"{dotted}={value!r} is not a finite number >= 0 and <= 1")
    return ratio


def _ds_stage3(d: Mapping, kwargs: dict[str, Any], bucket_mb: float) -> None:
    """Stage-3 sizes (elements): the prefetch size becomes whole gather units of bucket_mb
    (fp32 elements, as bucket sizes are counted), rounded up so that the prefetched units
    cover it, at least 1 and at most prefetch_units' 8; 0 keeps gathering on demand."""
    found, value = _ds_get(d, "zero_optimization.stage3_prefetch_bucket_size")
    if found:
        size = real("zero_optimization.stage3_prefetch_bucket_size", value, ge=0)
        unit = bucket_mb * 2**20 / 4
        kwargs["prefetch_units"] = 0 if size == 0 else min(8, max(1, math.ceil(size / unit)))
    for dotted, name, lo in (("zero_optimization.stage3_param_persistence_threshold", "param_persistence_threshold", 0),
                             ("zero_optimization.stage3_max_live_parameters", "max_live_params", 1)):
        found, value = _ds_get(d, dotted)
        if found:
            # DeepSpeed's lean max_live_parameters=0 keeps nothing gathered ahead: each unit alone, as 1 does here.
            kwargs[name] = max(lo, integer(dotted, whole(value), 0))


def _ds_zeropp(d: Mapping, kwargs: dict[str, Any]) -> None:
    """ZeRO++ at stage 3: qwZ is int8 weight all-gathers, qgZ int4 gradient reduce-scatters (DeepSpeed's
    widths), hpZ a secondary parameter copy in groups of zero_hpz_partition_size consecutive ranks."""
    if _ds_flag(d, "zero_optimization.zero_quantized_weights"):
        kwargs["quantize_weights"] = "int8"
    if _ds_flag(d, "zero_optimization.zero_quantized_gradients"):
        kwargs["quantize_grads"] = "int4"
    size = _hpz_size(d)
    if size is not None and size > 1:
        kwargs["hierarchy"], kwargs["ranks_per_node"] = "hpz", size


def _hpz_size(d: Mapping) -> int | None:
    """zero_hpz_partition_size as an int >= 1 (8.0 in JSON is 8), or None when absent."""
    found, value = _ds_get(d, "zero_optimization.zero_hpz_partition_size")
    if not found:
        return None
    return integer("zero_optimization.zero_hpz_partition_size", whole(value), 1)


class Translation(NamedTuple):
    """What a DeepSpeed config says, in zerompi's terms."""

    kwargs: dict[str, Any]
    """ZeroConfig keyword arguments (the caller applies its overrides on top)."""
    schedule: DeepSpeedSchedule | None
    """The scheduler block, or None."""
    batch: BatchKeys
    """The batch keys given (zerompi.deepspeed completes and checks them)."""
    no_effect: tuple[str, ...]
    """Dotted keys accepted without any effect in zerompi (to be named in one warning)."""
    gather_16bit: bool = False
    """stage3_gather_16bit_weights_on_model_save (in any spelling): save_16bit_model may gather at stage 3."""
    muon: ds_muon.MuonSettings | None = None
    """type Muon's halves: zerompi.deepspeed.initialize cuts the param groups by them (muon.py)."""


def translate(d: Mapping[str, Any], model: nn.Module | None = None, overrides: Mapping[str, Any] | None = None,
              defaults: Mapping[str, Any] | None = None) -> Translation:
    """Translate a DeepSpeed config (unsupported keys: one ConfigError listing them all).

    ``overrides`` and ``defaults`` are ZeroConfig field values that resolve "auto" (auto.py);
    ``model`` gives the hidden size the tuning sizes' "auto" follow.
    """
    d, ignored, renamed = screen(d)
    try:  # keys named as the document spells them
        t = _translate(d, ignored, model, overrides or {}, defaults or {})
    except ConfigError as e:
        raise respelled(e, renamed) from None
    return t._replace(no_effect=tuple(respell(k, renamed) for k in t.no_effect))


def _translate(d: Mapping[str, Any], ignored: list[str], model: nn.Module | None, overrides: Mapping[str, Any],
               defaults: Mapping[str, Any]) -> Translation:
    auto_warmup = is_auto(_ds_get(d, "scheduler.params.warmup_num_steps")[1])
    d = resolve_auto(d, model, overrides, defaults)
    kwargs: dict[str, Any] = {"stage": 0, "clip_grad_norm": 1.0}  # DeepSpeed 0.19's defaults
    _ds_zero(d, kwargs)
    ignored += read_swap(d, kwargs)
    _ds_precision(d, kwargs)
    muon = _ds_optimizer(d, kwargs)
    for dotted, name in _DS_DIRECT:
        if muon is not None and dotted.startswith("optimizer."):
            continue  # read by ds_muon.read, half by half
        found, value = _ds_get(d, dotted)
        if found:
            kwargs[name] = CHECKS[name](dotted, value)
    if _ds_get(d, "zero_optimization.overlap_comm")[0]:
        kwargs["overlap_grad_reduce"] = _ds_flag(d, "zero_optimization.overlap_comm")
    stage3 = overrides.get("stage", kwargs["stage"]) == 3
    if stage3:
        bucket_mb = overrides.get("bucket_mb", kwargs.get("bucket_mb", defaults.get("bucket_mb", 25.0)))
        _ds_stage3(d, kwargs, real("bucket_mb", bucket_mb, gt=0))
        _ds_zeropp(d, kwargs)
    return Translation(kwargs, read_schedule(d, auto_warmup), read_batch_keys(d),
                       tuple(ignored + _ds_no_effect(d, stage3)), _ds_flag(d, SAVE_16BIT), muon)


def deepspeed_kwargs(d: Mapping[str, Any], model: nn.Module | None = None,
                     overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """ZeroConfig keyword arguments for a DeepSpeed config, without overrides applied
    (unsupported keys: one ConfigError)."""
    return translate(d, model, overrides).kwargs


def warning_text(t: Translation, lr: float, schedule_applied: bool) -> str | None:
    """The one warning a translation deserves: the keys that change nothing, and a scheduler
    block that only zerompi.deepspeed applies (None when there is nothing to say)."""
    parts = []
    if t.no_effect:
        parts.append("DeepSpeed config keys accepted with no effect in zerompi (tuning, logging and monitoring "
                     "settings that leave the result unchanged, which its own buckets, swap settings, overlap, "
                     "checkpoints and metrics replace): " + ", ".join(sorted(t.no_effect)))
    if t.schedule is not None and not schedule_applied and not t.schedule.is_constant(lr):
        parts.append(f"scheduler.type={t.schedule.kind!r} is applied by zerompi.deepspeed.initialize; with "
                     "zerompi.initialize pass lr_scheduler=zerompi.deepspeed.scheduler_factory(config)")
    return "; ".join(parts) or None


def translate_config(d: Mapping[str, Any], model: nn.Module | None = None,
                     overrides: Mapping[str, Any] | None = None) -> tuple[ZeroConfig, Translation]:
    """The ZeroConfig of a DeepSpeed config with ``overrides`` (ZeroConfig field values) applied on
    top, and the whole translation (its schedule, batch keys and keys without effect)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"DeepSpeed config={d!r} is not a mapping")
    overrides = dict(overrides or {})
    names = [f.name for f in fields(ZeroConfig)]
    reject_unknown(overrides, names, "DeepSpeed config overrides")
    overrides = {k: CHECKS[k](k, v) for k, v in overrides.items()}
    defaults = {f.name: f.default for f in fields(ZeroConfig) if f.default is not MISSING}
    t = translate(d, model, overrides, defaults)
    return ZeroConfig(**{**t.kwargs, **overrides}), t


def config_from(d: Mapping[str, Any], model: nn.Module | None = None, **overrides: Any) -> ZeroConfig:
    """Translate a DeepSpeed JSON config; ``overrides`` are field values applied on top.

    Keys zerompi cannot honour are all listed in one ConfigError; tuning keys with no effect are
    named in one warning. Left-out settings take DeepSpeed's defaults where they change training
    (stage 0; clipping at 1.0; no weight decay in a given optimizer block), else ZeroConfig's.
    "auto" values resolve from ``overrides`` or the defaults, tuning sizes from ``model``'s hidden
    size (auto.py). A scheduler block is checked here and applied by ``zerompi.deepspeed.initialize``."""
    cfg, t = translate_config(d, model, overrides)
    if t.muon is not None:
        raise ConfigError("optimizer.type='Muon' cuts the model's parameters into a Muon and an Adam half, which "
                          "a config alone cannot give zerompi.initialize: train through zerompi.deepspeed.initialize "
                          "(or give zerompi.initialize param_groups with an 'optimizer' of their own)")
    text = warning_text(t, cfg.lr, schedule_applied=False)
    if text:
        warnings.warn(text, stacklevel=2)
    return cfg


class DeepSpeedDialect:
    """DeepSpeed JSON as a config dialect that ZeroConfig.from_file recognises (config/dialects.py)."""

    name = "DeepSpeed"
    recognises = staticmethod(looks_like_deepspeed)
    read = staticmethod(config_from)
