"""One declaration per config key: default, check, the policy field it fills and its spelling in other dialects.

A section (sections/) declares each key once, as a field of its ``Keys`` dataclass::

    offload_params: Offload = key(Offload.NONE, checks.of(Offload), policy="params",
                                  spelled={"DeepSpeed": "zero_optimization.offload_param.device"})
    \"\"\"Stage 3: where the parameter shards live between gathers: 'none', 'cpu' or 'nvme'.\"\"\"

with the type as the annotation and the documentation as the docstring below it. From these declarations
come the checks ``ZeroConfig`` runs (``checks_of``), the section's policy (``build``: each policy field is
filled from the key of that name, or the key declaring it as ``policy``), the keys another framework's
config (a dialect, dialects.py) carries unchanged under its own name (``spellings``) and the reference
page (zerompi/tools/config_reference.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Check = Callable[[str, Any], Any]
"""``check(key, value)`` -> the normalised value, or ConfigError naming the key and what is allowed."""

CHECK, POLICY, SPELLED = "zerompi.check", "zerompi.policy", "zerompi.spelled"


def key(default: Any = dataclasses.MISSING, check: Check | None = None, *, factory: Callable[[], Any] | None = None,
        policy: str | None = None, spelled: Mapping[str, str] | None = None) -> Any:
    """A config key's declaration (a dataclass field): ``default`` (or ``factory`` for a mutable one), the
    ``check`` every value passes, the ``policy`` field it fills when not the key's own name, and, by dialect,
    the dotted key of that dialect's config that carries it unchanged."""
    if check is None:
        raise TypeError("a config key needs its check")
    meta = {CHECK: check, POLICY: policy, SPELLED: dict(spelled or {})}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def checks_of(sections: Iterable[type]) -> dict[str, Check]:
    """Every declared key's check, by key."""
    return {f.name: f.metadata[CHECK] for section in sections for f in dataclasses.fields(section)}


def spellings(sections: Iterable[type], dialect: str) -> tuple[tuple[str, str], ...]:
    """(the dialect's dotted key, zerompi's key) for every key that ``dialect``'s config carries unchanged."""
    return tuple((f.metadata[SPELLED][dialect], f.name) for section in sections for f in dataclasses.fields(section)
                 if dialect in f.metadata[SPELLED])


def feeds(f: dataclasses.Field) -> str:
    """The policy field a key fills: its own name unless it declares another."""
    return f.metadata[POLICY] or f.name


def build(policy: type, keys: Any, section: type, **derived: Any) -> Any:
    """``policy`` filled from ``section``'s keys as ``keys`` (the config) holds them; ``derived`` gives the
    fields that no key of the section fills (a value of another section, or one computed from several)."""
    by_field = {feeds(f): getattr(keys, f.name) for f in dataclasses.fields(section)}
    values = {}
    for target in dataclasses.fields(policy):
        if target.name in derived:
            values[target.name] = derived[target.name]
        elif target.name in by_field:
            values[target.name] = by_field[target.name]
        elif target.default is dataclasses.MISSING and target.default_factory is dataclasses.MISSING:
            raise TypeError(f"{policy.__name__}.{target.name}: no key of {section.__name__} fills it, and it is "
                            "not derived")
    return policy(**values)
