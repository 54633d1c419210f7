"""The ``"auto"`` values of Hugging Face's DeepSpeed templates, resolved before translation.

Hugging Face's Trainer fills every ``"auto"`` from its own arguments before DeepSpeed
reads the config. zerompi has no Trainer, so :func:`resolve_auto` fills them here and
returns a copy of the document without any ``"auto"``:

* training values (optimizer params, accumulation, clipping, precision switches,
  fp16 loss-scale keys, warm-up numbers) take the ZeroConfig field given in
  ``overrides``, else that field's default (``defaults``); ``fp16.enabled`` and
  ``bf16.enabled`` are on only when ``overrides`` asks for that dtype;
* the scheduler's ``warmup_min_lr`` is 0 (Hugging Face's value), ``warmup_max_lr`` the
  learning rate, ``warmup_min_ratio`` 0 and ``cos_min_ratio`` ``min_lr / lr``;
  ``total_num_steps`` needs ``total_steps`` in ``overrides``: there is no default;
* tuning sizes follow Hugging Face from the model's hidden size h (:func:`hidden_size`):
  ``reduce_bucket_size`` = h², ``stage3_prefetch_bucket_size`` = 0.9·h²,
  ``stage3_param_persistence_threshold`` = 10·h; without a model the key is dropped,
  so zerompi's default applies;
* batch sizes are dropped: "not given" (zerompi.deepspeed derives them as DeepSpeed does);
* a value that resolves to None (no override and no default given) is dropped too;
* any other ``"auto"`` in a block DeepSpeed reads through its pydantic models (``zero_optimization``
  but its ``stage``, the offload blocks, ``fp16``, ``bf16``, the monitors) is dropped: those models
  drop "auto" themselves, so DeepSpeed's default applies, as when the key is left out
  (``stage3_max_live_parameters: "auto"`` is the same as no bound, ``sub_group_size: "auto"`` as none).

Any other ``"auto"`` (a ZeRO stage, a scheduler's ``total_num_steps`` without ``total_steps``, the
``aio`` and optimizer keys DeepSpeed passes on as they are) stays, and the translation refuses it
under its own key.
"""
from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from zerompi.errors import ConfigError

AUTO = "auto"
_DROP = object()  # the key is removed: zerompi's default applies


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def hidden_size(model: nn.Module | None) -> int | None:
    """The model's hidden size: ``model.config.hidden_size`` (or the largest of ``hidden_sizes``),
    else ``n_embd`` of ``model.config`` or of the model, else the largest ``in_features`` of
    its ``nn.Linear`` layers; None without a model or any of these."""
    if model is None:
        return None
    cfg = getattr(model, "config", None)
    for owner, name in ((cfg, "hidden_size"), (cfg, "n_embd"), (model, "n_embd")):
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    sizes = getattr(cfg, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return max(sizes)
    linear = [m.in_features for m in model.modules() if isinstance(m, nn.Linear)]
    return max(linear) if linear else None


def _field(name: str, overrides: Mapping, defaults: Mapping) -> Any:
    return overrides[name] if name in overrides else defaults.get(name)


def _rules(model: nn.Module | None, overrides: Mapping, defaults: Mapping,
           lr: float) -> dict[str, Callable[[], Any]]:
    """Dotted key -> the value its "auto" resolves to (or _DROP)."""
    h = hidden_size(model)
    dtype = str(getattr(overrides.get("dtype"), "value", overrides.get("dtype")))
    get = lambda name: lambda: _field(name, overrides, defaults)  # noqa: E731
    rules: dict[str, Callable[[], Any]] = {
        "fp16.enabled": lambda: dtype == "fp16", "bf16.enabled": lambda: dtype == "bf16",
        "gradient_accumulation_steps": get("grad_accum_steps"),
        # None (no clipping) is spelled 0 in DeepSpeed.
        "gradient_clipping": lambda: _field("clip_grad_norm", overrides, defaults) or 0.0,
        "train_batch_size": lambda: _DROP, "train_micro_batch_size_per_gpu": lambda: _DROP,
        "zero_optimization.reduce_bucket_size": lambda: h * h if h else _DROP,
        "zero_optimization.stage3_prefetch_bucket_size": lambda: int(0.9 * h * h) if h else _DROP,
        "zero_optimization.stage3_param_persistence_threshold": lambda: 10 * h if h else _DROP,
        "scheduler.params.warmup_min_lr": lambda: 0.0,
        "scheduler.params.warmup_max_lr": lambda: lr,
        "scheduler.params.warmup_num_steps": get("warmup_steps"),
        "scheduler.params.total_num_steps": lambda: _needs(overrides, "total_steps",
                                                           "scheduler.params.total_num_steps"),
        "scheduler.params.warmup_min_ratio": lambda: 0.0,
        "scheduler.params.cos_min_ratio": lambda: (_field("min_lr", overrides, defaults) or 0.0) / lr,
    }
    for key in ("lr", "betas", "eps", "weight_decay", "momentum"):
        rules[f"optimizer.params.{key}"] = get(key)
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        rules[f"fp16.{key}"] = get(key)
    return rules


# Blocks DeepSpeed 0.19.8 validates with pydantic models that drop "auto" values (runtime/config_utils.py).
_DEFAULTED = ("zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
              "fp16", "bf16", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger")
_KEPT = ("zero_optimization.stage",)  # refused under its own key: a stage is no tuning default


def _drop_defaulted(doc: dict) -> None:
    for dotted in _DEFAULTED:
        node: Any = doc
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            for key in [k for k, v in node.items() if is_auto(v) and f"{dotted}.{k}" not in _KEPT]:
                del node[key]


def _needs(overrides: Mapping, name: str, dotted: str) -> Any:
    if name not in overrides:
        raise ConfigError(f"{dotted}='auto' cannot be resolved: zerompi has no default for it; "
                          f"pass {name}=N (from_deepspeed or zerompi.deepspeed.initialize overrides) "
                          "or write the number into the config")
    return overrides[name]


def _positive(value: Any) -> bool:
    """A finite number > 0 (not a bool, not an int beyond the float range)."""
    try:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    except OverflowError:
        return False


def resolve_auto(doc: Mapping[str, Any], model: nn.Module | None, overrides: Mapping[str, Any],
                 defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``doc`` with each resolvable ``"auto"`` replaced (see the module docstring)."""
    out = copy.deepcopy(dict(doc))
    params = out.get("optimizer", {}).get("params", {}) if isinstance(out.get("optimizer"), Mapping) else {}
    lr = params.get("lr") if isinstance(params, Mapping) else None
    if not _positive(lr):
        lr = _field("lr", overrides, defaults)  # a bad explicit lr is reported under its own key later
    lr = overrides.get("lr", lr)
    lr = lr if _positive(lr) else 1.0  # only ratios use it, and the bad lr is reported later
    for dotted, resolve in _rules(model, overrides, defaults, lr).items():
        *parents, leaf = dotted.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, dict) and is_auto(node.get(leaf)):
            value = resolve()
            if value is _DROP or value is None:
                del node[leaf]
            else:
                node[leaf] = list(value) if isinstance(value, tuple) else value
    _drop_defaulted(out)
    return out
