"""A DeepSpeed ``scheduler`` block, checked and read into a :class:`DeepSpeedSchedule`.

DeepSpeed's ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR`` (deepspeed 0.19.8,
``runtime/lr_schedules.py``) are supported, with DeepSpeed's defaults for left-out
params. Their learning rates differ from zerompi's ``warmup_*`` schedules (DeepSpeed's
first optimizer step runs at the warm-up start, its warm-up is logarithmic by default,
its decay lags one step), so they run as their own LambdaLR factors
(zerompi/compat/deepspeed/lr_schedules.py), which reproduce DeepSpeed's numbers step for step.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerompi.config.checks import integer, listing, real
from zerompi.errors import ConfigError

_COMMON = ("warmup_num_steps", "warmup_type")
PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", *_COMMON),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", *_COMMON),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "cos_min_ratio", *_COMMON),
}
"""The params each supported scheduler type takes."""
ALL_PARAMS = tuple(sorted({p for ps in PARAMS.values() for p in ps}))
_WARMUP_TYPES = ("log", "linear")


@dataclass(frozen=True)
class DeepSpeedSchedule:
    """One DeepSpeed scheduler, its params resolved (DeepSpeed's defaults filled in)."""

    kind: str
    """'WarmupLR', 'WarmupDecayLR' or 'WarmupCosineLR'."""
    warmup_num_steps: int
    """Warm-up length as DeepSpeed uses it (max(2, given)); 0 only from an "auto" resolved to
    zerompi's warmup_steps=0: no warm-up."""
    warmup_log: bool
    """Logarithmic warm-up (DeepSpeed's default) rather than linear."""
    warmup_min_lr: float = 0.0
    """WarmupLR/WarmupDecayLR: the learning rate the warm-up starts at."""
    warmup_max_lr: float | None = None
    """WarmupLR/WarmupDecayLR: the learning rate it reaches; None: each param group's own lr."""
    total_num_steps: int | None = None
    """WarmupDecayLR/WarmupCosineLR: the step at which the decay ends."""
    warmup_min_ratio: float = 0.0
    """WarmupCosineLR: the warm-up's start as a fraction of each group's lr."""
    cos_min_ratio: float = 0.0001
    """WarmupCosineLR: the end of the cosine decay as a fraction of each group's lr."""

    def is_constant(self, lr: float) -> bool:
        """Whether the learning rate stays ``lr`` throughout (zerompi's 'constant' schedule, with
        one param group: DeepSpeed sets every group to warmup_max_lr)."""
        return self.kind == "WarmupLR" and self.warmup_num_steps == 0 and self.warmup_max_lr in (None, lr)


def read_schedule(doc: Mapping[str, Any], auto_warmup: bool) -> DeepSpeedSchedule | None:
    """The ``scheduler`` block of ``doc`` (its "auto" values already resolved), or None.

    ``auto_warmup``: warmup_num_steps came from an "auto", so 0 is allowed and means no warm-up.
    """
    block = doc.get("scheduler")
    if block is None:
        return None
    kind = block.get("type")
    if not isinstance(kind, str) or kind not in PARAMS:
        shown = repr(kind) if "type" in block else "(missing)"
        raise ConfigError(f"scheduler.type={shown} is not one of {listing(PARAMS)}; other DeepSpeed or "
                          "torch schedulers: build them yourself and pass lr_scheduler=")
    params = block.get("params", {})
    wrong = sorted(f"scheduler.params.{k}" for k in params if k not in PARAMS[kind])
    if wrong:
        raise ConfigError(f"{', '.join(wrong)} do(es) not apply to scheduler.type={kind!r}; "
                          f"allowed params: {', '.join(PARAMS[kind])}")
    key = "scheduler.params."
    steps = integer(key + "warmup_num_steps", params.get("warmup_num_steps", 1000), 0 if auto_warmup else 1)
    wtype = params.get("warmup_type", "log")
    if not isinstance(wtype, str) or wtype not in _WARMUP_TYPES:
        raise ConfigError(f"{key}warmup_type={wtype!r} is not one of {listing(_WARMUP_TYPES)}")
    out: dict[str, Any] = dict(kind=kind, warmup_num_steps=max(2, steps) if steps else 0, warmup_log=wtype == "log")
    if kind != "WarmupLR":
        if "total_num_steps" not in params:
            raise ConfigError(f"{key}total_num_steps is missing; {kind} needs it (an int >= 1)")
        out["total_num_steps"] = integer(key + "total_num_steps", params["total_num_steps"], 1)
    if kind == "WarmupCosineLR":
        for name, default in (("warmup_min_ratio", 0.0), ("cos_min_ratio", 0.0001)):
            out[name] = real(key + name, params.get(name, default), ge=0)
        return DeepSpeedSchedule(**out)
    out["warmup_min_lr"] = real(key + "warmup_min_lr", params.get("warmup_min_lr", 0.0), ge=0)
    # WarmupLR's default top is each group's lr; WarmupDecayLR's is 0.001.
    top = params.get("warmup_max_lr", None if kind == "WarmupLR" else 0.001)
    if top is not None:
        top = real(key + "warmup_max_lr", top, gt=0)
    out["warmup_max_lr"] = top
    return DeepSpeedSchedule(**out)
