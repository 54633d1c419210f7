"""The counts ``zerompi estimate`` takes on its command line: parameters and world sizes."""
from __future__ import annotations

from decimal import Decimal, InvalidOperation

from zerompi.errors import ConfigError

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_MAX_RANK_VALUES = 1000


def parse_count(text: str, flag: str = "--params", minimum: int = 1) -> int:
    """A parameter count: ``7500000000``, ``7.5e9``, ``7.5B``, ``350M``, ``125k``, ``1T`` (>= ``minimum``)."""
    raw = text.strip().replace("_", "").replace(",", "")
    scale = 1
    if raw[-1:].lower() in _SUFFIXES:
        scale, raw = _SUFFIXES[raw[-1].lower()], raw[:-1]
    try:
        value = Decimal(raw) * scale
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite() or value < minimum or value != value.to_integral_value():
        raise ConfigError(f"{flag} {text!r} is not a whole number of parameters >= {minimum} "
                          "(e.g. 7500000000, 7.5e9, 7.5B, 350M, 125k)")
    return int(value)


def _rank_range(item: str) -> list[int]:
    """``A-B`` every integer, ``A-B:S`` in steps of S, ``A-B*F`` multiplying by F."""
    lo_text, hi_text = item.split("-", 1)
    step_op, step = "+", "1"
    for op in (":", "*"):
        if op in hi_text:
            hi_text, step = hi_text.split(op, 1)
            step_op = op
    lo, hi, s = int(lo_text), int(hi_text), int(step)
    if lo < 1 or hi < lo or s < (2 if step_op == "*" else 1):
        raise ValueError(item)
    out, v = [], lo
    while v <= hi and len(out) <= _MAX_RANK_VALUES:
        out.append(v)
        v = v * s if step_op == "*" else v + s
    return out


def parse_ranks(text: str) -> list[int]:
    """World sizes: ``64``, ``1,4,16,64``, ``1-8``, ``8-64:8``, ``1-1024*4``; in order, without repeats."""
    values: list[int] = []
    try:
        for item in text.replace(" ", "").split(","):
            values += _rank_range(item) if "-" in item else [int(item)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"--ranks {text!r} is not a list of world sizes >= 1 "
                          "(e.g. 64, 1,4,16,64, 1-8, 8-64:8, 1-1024*4)")
    if len(values) > _MAX_RANK_VALUES:
        raise ConfigError(f"--ranks {text!r} gives more than {_MAX_RANK_VALUES} world sizes")
    return list(dict.fromkeys(values))
