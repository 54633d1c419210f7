"""Validators of config values (each key's own is named in its declaration, sections/), and the rules
that relate several keys.

Every validator is called as ``check(key, value, ...)`` and returns the
normalised value or raises :class:`ConfigError` naming ``key``, the value and
what is allowed. The key is a parameter so that a DeepSpeed translation reports
errors under DeepSpeed's dotted names.
"""
from __future__ import annotations

import difflib
import importlib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any, TypeVar

import torch

from zerompi.config.choices import CheckpointLayout, DType, NonFinite, Offload, RecoverySource, Schedule, Stage
from zerompi.errors import ConfigError

E = TypeVar("E", bound=Enum)
Check = Callable[[str, Any], Any]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
    "muon": torch.optim.AdamW}  # Muon on the hidden matrices, this on the rest (optim/presets.py)
"""The optimizers ``optimizer`` may name by a short string."""
_ADAM_ARGS = ("lr", "betas", "eps", "weight_decay")
FIELD_ARGS: dict[str, tuple[str, ...]] = {
    "adamw": _ADAM_ARGS, "adam": _ADAM_ARGS, "sgd": ("lr", "momentum", "weight_decay"), "muon": _ADAM_ARGS,
    "zerompi.optim.adam.UncorrectedAdam": _ADAM_ARGS}
"""Optimizer arguments the engine fills from fields (``lr`` alone for other optimizers);
repeating one in optimizer_kwargs would be a second spelling of the same setting."""


def kind_of(default: Any) -> str:
    """How a message names the kind of value ``default`` is: 'a whole number', 'true or false', ..."""
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
            list: "a list"}.get(type(default), type(default).__name__)


def same_kind(value: Any, default: Any) -> bool:
    """A file's value where ``default`` is: the same kind (a whole number also where a number is; bool only
    for bool; anything where the default is None)."""
    if default is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def listing(values: Iterable[Any]) -> str:
    """``'a', 'b', 'c'``: allowed values as an error message lists them."""
    return ", ".join(repr(v) for v in values)


def integer(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    """An int (not a bool) in ``lo..hi``, or ``>= lo`` when ``hi`` is None."""
    rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
    # bool is an int subclass, but True as a step count is always a mistake.
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{key}={value!r} is not an int {rng}")
    return int(value)


def real(key: str, value: Any, *, gt: float | None = None, ge: float | None = None,
         lt: float | None = None) -> float:
    """A finite number (not a bool) within the given bounds, as a float."""
    bounds = [f"{op} {b}" for op, b in ((">", gt), (">=", ge), ("<", lt)) if b is not None]
    try:  # an int beyond the float range is no number a config can mean
        finite = isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:
        finite = False
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and finite and (gt is None or value > gt)
            and (ge is None or value >= ge) and (lt is None or value < lt)):
        raise ConfigError(f"{key}={value!r} is not a finite number {' and '.join(bounds)}")
    return float(value)


def nonnegative(key: str, value: Any) -> float:
    """A finite number >= 0."""
    return real(key, value, ge=0)


def boolean(key: str, value: Any) -> bool:
    """True or False (no truthy stand-ins)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a bool (true or false)")
    return value


def choice(key: str, value: Any, kind: type[E]) -> E:
    """The member of the enum ``kind`` whose value is the string ``value`` (or the member itself)."""
    member = kind._value2member_map_.get(value) if isinstance(value, str) else None
    if member is None:
        raise ConfigError(f"{key}={value!r} is not one of {listing(m.value for m in kind)}")
    return member


def stage(key: str, value: Any) -> Stage:
    """A ZeRO stage 0..3, as a :class:`Stage`."""
    return Stage(integer(key, value, 0, 3))


def optional(key: str, value: Any, check: Check, none_means: str) -> Any:
    """None, or what ``check`` makes of ``value``; errors add what None would mean."""
    if value is None:
        return None
    try:
        return check(key, value)
    except ConfigError as e:
        raise ConfigError(f"{e}, or None ({none_means})") from None


def path(key: str, value: Any) -> str:
    """A non-empty path string (an os.PathLike becomes its string)."""
    p = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(p, str) or not p:
        raise ConfigError(f"{key}={value!r} is not a non-empty path string")
    return p


def betas(key: str, value: Any) -> tuple[float, float]:
    """A pair of numbers in [0, 1), as a tuple; errors name the element as ``key[i]``."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ConfigError(f"{key}={value!r} is not a pair of finite numbers >= 0 and < 1")
    b1, b2 = (real(f"{key}[{i}]", b, ge=0, lt=1) for i, b in enumerate(value))
    return (b1, b2)


def str_mapping(key: str, value: Any) -> dict:
    """A mapping with str keys, copied into a dict."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{key}={value!r} is not a dict with str keys")
    return dict(value)


def block_kib(key: str, value: Any) -> int:
    """An NVMe I/O request size in KiB: a multiple of 4 in 4..262144."""
    value = integer(key, value, 4, 256 * 1024)
    if value % 4:
        raise ConfigError(f"{key}={value!r} is not a multiple of 4 KiB (O_DIRECT needs page-aligned I/O)")
    return value


def quant_block(key: str, value: Any) -> int:
    """Values per quantisation scale: an even int in 2..65536 (int4 packs two codes a byte)."""
    value = integer(key, value, 2, 65536)
    if value % 2:
        raise ConfigError(f"{key}={value!r} is not an even int in 2..65536")
    return value


def align_kib(key: str, value: Any) -> int:
    """A file alignment in KiB: a power of two in 4..1048576 (4 KiB to 1 GiB)."""
    value = integer(key, value, 4, 1 << 20)
    if value & (value - 1):
        raise ConfigError(f"{key}={value!r} is not a power of two; allowed: 4, 8, ..., 1024 (1 MiB), ..., 1048576")
    return value


def _import_dotted(key: str, dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # an import can fail in any way; report it as a config error
        raise ConfigError(f"{key}={dotted!r} cannot be imported as 'package.module.ClassName': "
                          f"{type(e).__name__}: {e}") from None


def optimizer_class(key: str, value: Any) -> type[torch.optim.Optimizer]:
    """The Optimizer subclass a short name, a class or a dotted path names."""
    if isinstance(value, str) and value in OPTIMIZERS:
        return OPTIMIZERS[value]
    if isinstance(value, str) and "." in value:
        cls = _import_dotted(key, value)
    elif isinstance(value, type):
        cls = value
    else:
        raise ConfigError(f"{key}={value!r} is not one of {listing(OPTIMIZERS)}, a subclass of "
                          "torch.optim.Optimizer, or a dotted path 'package.module.ClassName'")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer):
        raise ConfigError(f"{key}={value!r} resolves to {cls!r}, which is not a subclass of "
                          "torch.optim.Optimizer; allowed: " + listing(OPTIMIZERS)
                          + ", an Optimizer subclass or a dotted path to one")
    return cls


def of(kind: type[Enum]) -> Check:
    """The check of one member (or value) of the enum ``kind``."""
    return lambda k, v: choice(k, v, kind)


def positive(key: str, value: Any) -> float:
    """A finite number > 0."""
    return real(key, value, gt=0)


def whole(lo: int, hi: int | None = None) -> Check:
    """The check of a whole number in ``lo``..``hi``."""
    return lambda k, v: integer(k, v, lo, hi)


def maybe(check: Check, none_means: str) -> Check:
    """The check of None (which means ``none_means``) or what ``check`` accepts."""
    return lambda k, v: optional(k, v, check, none_means)


def kept_optimizer(key: str, value: Any) -> Any:
    """An optimizer as given (not the resolved class), so to_dict writes back what the user wrote."""
    optimizer_class(key, value)
    return value


def clip_norm(key: str, value: Any) -> float | None:
    """A norm >= 0, with 0 stored as None: one spelling for "no clipping" downstream."""
    return optional(key, value, nonnegative, "no clipping") or None


def check_offload(cfg: Any) -> None:
    """Cross-field rules of offloading, checked after every field is valid."""
    if cfg.offload_optimizer != Offload.NONE and not cfg.stage.shards_optimizer:
        raise ConfigError(f"offload_optimizer={cfg.offload_optimizer!r} needs a sharded optimizer: "
                          "stage=0 is not allowed; allowed: stage 1, 2 or 3")
    if cfg.offload_params != Offload.NONE and not cfg.stage.shards_params:
        raise ConfigError(f"offload_params={cfg.offload_params!r} needs sharded parameters: "
                          f"stage={cfg.stage} is not allowed; allowed: stage 3")
    if cfg.param_persistence_threshold and not cfg.stage.shards_params:
        raise ConfigError(f"param_persistence_threshold={cfg.param_persistence_threshold} keeps small parameters "
                          f"gathered, which only stage 3 shards; stage={cfg.stage}; allowed: 0, or stage 3")
    if Offload.NVME in (cfg.offload_optimizer, cfg.offload_params) and cfg.nvme_path is None:
        raise ConfigError("nvme_path=None: offloading to 'nvme' needs a directory for the swap files")


def check_fault_tolerance(cfg: Any) -> None:
    """What surviving a lost rank needs of the rest of the config (comm/ulfm.py, recovery.py)."""
    if not cfg.fault_tolerance:
        return
    if cfg.micro_batches is None:
        raise ConfigError("fault_tolerance=True needs micro_batches (the global batch, dealt over whichever ranks "
                          "are left), so that the survivors run the same global batch; allowed: an int >= the "
                          "number of ranks (with reproducible=True the recovered run is bitwise the failure-free "
                          "one), or fault_tolerance=False")
    if cfg.checkpoint_layout == CheckpointLayout.SHARED:
        raise ConfigError("fault_tolerance=True with checkpoint_layout='shared': a collective HDF5 write "
                          "cannot survive a lost rank; allowed: 'per_rank' or 'auto'")
    if cfg.recovery_source == RecoverySource.MEMORY and Offload.NVME in (cfg.offload_optimizer, cfg.offload_params):
        raise ConfigError("recovery_source='memory' with offload to 'nvme' would hold two copies of what the swap "
                          "file keeps out of memory; allowed: recovery_source='disk', or offload 'cpu' or 'none'")


def check_schedule(cfg: Any) -> None:
    """A decaying schedule needs to know where it ends, after the warm-up."""
    if cfg.lr_schedule == Schedule.CONSTANT:
        return
    if cfg.total_steps is None or cfg.total_steps <= cfg.warmup_steps:
        raise ConfigError(f"lr_schedule={cfg.lr_schedule!r} decays until total_steps, which must be more than "
                          f"warmup_steps={cfg.warmup_steps}; got total_steps={cfg.total_steps!r}; allowed: an int "
                          f"> {cfg.warmup_steps}, or lr_schedule='constant'")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"min_lr={cfg.min_lr!r} is above lr={cfg.lr!r}; allowed: 0 <= min_lr <= lr")


def check_quantization(cfg: Any) -> None:
    """Compressed collectives replace a stage's reduce-scatter and all-gathers, which stage 0 has not."""
    for key in ("quantize_weights", "quantize_grads"):
        if getattr(cfg, key).bits is not None and not cfg.stage.shards_optimizer:
            raise ConfigError(f"{key}={getattr(cfg, key)!r} compresses a reduce-scatter or all-gather; stage=0 "
                              "all-reduces its gradients; allowed: 'none', or stage 1, 2 or 3")
    if cfg.grad_error_feedback and cfg.quantize_grads.bits is None:
        raise ConfigError("grad_error_feedback=True carries the error of quantized gradients to the next step, but "
                          "quantize_grads='none' quantizes nothing; allowed: False, or quantize_grads 'int8' or 'int4'")


def check_in_backward(cfg: Any) -> None:
    """A bucket updated during backward cannot wait for what only the whole gradient tells."""
    if not cfg.optimizer_in_backward:
        return
    key = "optimizer_in_backward=True"
    if not cfg.stage.shards_grads:
        raise ConfigError(f"{key} updates each bucket as its reduce-scatter lands, which stages 2 and 3 do "
                          f"during backward; stage={cfg.stage}; allowed: stage 2 or 3, or optimizer_in_backward=False")
    if cfg.clip_grad_norm is not None:
        raise ConfigError(f"{key} updates a bucket before the global gradient norm is known, so it cannot clip; "
                          f"clip_grad_norm={cfg.clip_grad_norm!r}; allowed: None (or 0), or optimizer_in_backward=False")
    if cfg.dtype == DType.FP16:
        raise ConfigError(f"{key} updates a bucket before an fp16 overflow anywhere else could skip the step; "
                          "dtype='fp16'; allowed: 'fp32' or 'bf16', or optimizer_in_backward=False")
    if cfg.nonfinite != NonFinite.RAISE:
        raise ConfigError(f"{key} cannot skip a step whose buckets are already updated; nonfinite="
                          f"{cfg.nonfinite.value!r}; allowed: 'raise', or optimizer_in_backward=False")


def check_optimizer_kwargs(cfg: Any) -> None:
    """optimizer_kwargs may not repeat what the engine or the fields set for the optimizer."""
    taken = ("params", *FIELD_ARGS.get(cfg.optimizer, ("lr",)))
    clash = [k for k in taken if k in cfg.optimizer_kwargs]
    if clash:
        raise ConfigError(f"optimizer_kwargs={cfg.optimizer_kwargs!r} sets {listing(clash)}, "
                          f"which the engine or the fields set for optimizer={cfg.optimizer!r}"
                          f"; allowed: any str key but {listing(taken)}")


def reject_unknown(keys: Iterable[Any], allowed: list[str], what: str) -> None:
    """Refuse keys not in ``allowed``, listing every unknown one."""
    unknown = sorted(str(k) for k in keys if k not in allowed)
    if unknown:
        named = [k + "".join(f" (did you mean {m}?)" for m in difflib.get_close_matches(k, allowed, n=1)) for k in unknown]
        raise ConfigError(f"unknown {what}: {', '.join(named)}; allowed: {', '.join(allowed)}")
