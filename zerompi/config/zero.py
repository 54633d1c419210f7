"""Configuration of a zerompi engine: one frozen, validated :class:`ZeroConfig`.

Every value is checked once, in ``__post_init__``, so the rest of the package can trust it; a bad
value raises :class:`ConfigError` naming the key, the value and what is allowed. A config comes from
keyword arguments, a plain dict (``from_dict``) or a TOML or JSON file (``from_file``), which also reads
the dialects registered in dialects.py (DeepSpeed JSON, translated key by key by zerompi.compat.deepspeed:
what zerompi lacks is refused, never ignored).

The keys are flat (``ZeroConfig(stage=3, offload_optimizer="cpu")``), and each belongs to one section
(sections/): a concern with its keys, their documentation and the frozen policy built from them once
(``cfg.offload``, ``cfg.precision``, ...). A component takes its section's policy, never the config.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

import torch

from zerompi.config import checks, dialects
from zerompi.config.declare import checks_of
from zerompi.config.files import read_document
from zerompi.config.reproducible import check_reproducible
from zerompi.config.sections.batch import BatchKeys
from zerompi.config.sections.checkpointing import CheckpointKeys
from zerompi.config.sections.compression import CompressionKeys
from zerompi.config.sections.offload import OffloadKeys
from zerompi.config.sections.optimization import OptimizationKeys
from zerompi.config.sections.overlap import OverlapKeys
from zerompi.config.sections.precision import PrecisionKeys
from zerompi.config.sections.recovery import RecoveryKeys
from zerompi.config.sections.reliability import ReliabilityKeys
from zerompi.config.sections.runtime import RuntimeKeys
from zerompi.config.sections.sharding import ShardingKeys
from zerompi.errors import ConfigError

SECTIONS = (ShardingKeys, OptimizationKeys, BatchKeys, PrecisionKeys, RuntimeKeys, OffloadKeys, OverlapKeys,
            CompressionKeys, CheckpointKeys, ReliabilityKeys, RecoveryKeys)
"""The config's sections in the order their keys are listed (``fields(ZeroConfig)``, ``to_dict``)."""
CHECKS = checks_of(SECTIONS)
"""Each key's check, as its section declares it: ``CHECKS[key](name, value)`` -> the normalised value (a
DeepSpeed translation passes DeepSpeed's dotted name, so errors name the key the document spells)."""


# A dataclass lists the fields of its bases from the last base to the first: reversed, so they read
# in SECTIONS' order.
@dataclass(frozen=True, eq=False, kw_only=True)
class ZeroConfig(*reversed(SECTIONS)):
    """Validated settings of a ZeRO data-parallel engine (each key's docstring is in its section).

    A choice field takes its enum member or the member's value ('bf16', 3) and holds
    the member (see choices.py); to_dict writes the plain values back. Equality
    compares the resolved optimizer class, so a config equals its own
    ``from_dict(to_dict())`` round trip even when built from a class object. Each
    section's policy (``precision``, ``offload``, ...) is built once, on first use.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ZeroConfig:
        # before the generated __init__, whose TypeError names neither the allowed keys nor a close match
        if args:
            raise ConfigError(f"ZeroConfig takes keyword arguments only (config keys), got {len(args)} positional "
                              f"value(s): {', '.join(repr(a) for a in args)[:200]}")
        checks.reject_unknown(kwargs, [f.name for f in fields(cls)], "config keys")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # Field order, so the first problem reported is the first field's; the
        # cross-field check comes last as it relies on the checked fields.
        for f in fields(self):
            object.__setattr__(self, f.name, CHECKS[f.name](f.name, getattr(self, f.name)))
        checks.check_offload(self)
        checks.check_schedule(self)
        checks.check_optimizer_kwargs(self)
        checks.check_quantization(self)
        checks.check_in_backward(self)
        check_reproducible(self)
        checks.check_fault_tolerance(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ZeroConfig):
            return NotImplemented
        return self._identity() == other._identity()

    def _identity(self) -> tuple:
        return tuple(self.optimizer_class() if f.name == "optimizer" else getattr(self, f.name)
                     for f in fields(self))

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict that from_dict accepts and JSON can hold."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update((k, v.value) for k, v in out.items() if isinstance(v, Enum))  # plain str / int
        if isinstance(self.optimizer, type):
            out["optimizer"] = f"{self.optimizer.__module__}.{self.optimizer.__qualname__}"
        out["betas"] = list(self.betas)
        out["optimizer_kwargs"] = copy.deepcopy(self.optimizer_kwargs)
        return out

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied and validated."""
        checks.reject_unknown(changes, [f.name for f in fields(self)], "config keys")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ZeroConfig:
        """Build from a mapping of field names to values; unknown keys are refused."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config={d!r} is not a mapping of config keys to values")
        checks.reject_unknown(d, [f.name for f in fields(cls)], "config keys")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | os.PathLike, table: str | None = None) -> ZeroConfig:
        """Read a .toml or .json file, or one top-level ``table`` of it; another framework's config
        that a registered dialect recognises (DeepSpeed JSON: zerompi.compat.deepspeed) is read
        through it (dialects.py)."""
        doc, where = read_document(path, table)
        dialect = dialects.recognising(doc)
        try:
            return dialect.read(doc) if dialect is not None else cls.from_dict(doc)
        except ConfigError as e:
            how = f" (read as a {dialect.name} config)" if dialect is not None else ""
            raise ConfigError(f"{where}{how}: {e}") from None

    @classmethod
    def from_deepspeed(cls, d: Mapping[str, Any], model: torch.nn.Module | None = None,
                       **overrides: Any) -> ZeroConfig:
        """Deprecated, kept for one release: ``zerompi.compat.deepspeed.config_from``."""
        warnings.warn("ZeroConfig.from_deepspeed is deprecated: use zerompi.compat.deepspeed.config_from "
                      "(the same translation)", DeprecationWarning, stacklevel=2)
        return dialects.named("DeepSpeed").read(d, model, **overrides)
