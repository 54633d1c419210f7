"""A DeepSpeed document screened before translation: old spellings renamed to the keys zerompi reads,
and every feature zerompi lacks and every unknown key refused together, in one ConfigError.

DeepSpeed 0.19.8 reads ``bfloat16`` for ``bf16`` (ignoring it when ``bf16`` is given), the deprecated
``stage3_gather_fp16_weights_on_model_save``, the field names its ZeRO model accepts beside the
``stage3_`` aliases, ``cpu_offload`` / ``cpu_offload_param`` (offload to the CPU) and the legacy
``"zero_optimization": true`` with a top-level ``allgather_size`` (stage 1). Each becomes the key
zerompi reads (keys.py), so old and new spellings translate to equal configs.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from zerompi.compat.deepspeed.auto import is_auto
from zerompi.compat.deepspeed.keys import ALIASES, DATA_EFFICIENCY, FEATURES, OPTIMIZER_FEATURES, SCHEMA, Feature
from zerompi.config.checks import boolean, real
from zerompi.errors import ConfigError

_MISSING = object()
# Deprecated switches and the block each one stands for when true.
_CPU_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def screen(doc: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """A copy of ``doc`` in the spellings zerompi reads, the keys DeepSpeed itself ignores there
    (``bfloat16`` beside ``bf16``, ``allgather_size`` without the legacy form), and each renamed key's
    spelling in ``doc`` (for :func:`respelled`). Refused features and unknown keys: one ConfigError
    naming each (a feature with its reason)."""
    d = copy.deepcopy(dict(doc))
    ignored = _legacy_zero(d) + _dotted_top_level(d)
    renamed: dict[str, str] = {}
    ignored += _rename(d, renamed)
    try:
        _screen(d)
    except ConfigError as e:
        raise respelled(e, renamed) from None
    return d, ignored, renamed


def respell(text: str, renamed: Mapping[str, str]) -> str:
    """``text`` with each renamed key (and the keys inside it) named as the document spells it."""
    for new, old in renamed.items():
        text = re.sub(rf"(?<![\w.]){re.escape(new)}(?=[.=,;:\s)]|$)", old, text)
    return text


def respelled(error: ConfigError, renamed: Mapping[str, str]) -> ConfigError:
    return ConfigError(respell(str(error), renamed))


def _screen(d: dict) -> None:
    _cpu_offload(d)
    refused = _features(d)
    unsupported: list[str] = []
    _walk(d, SCHEMA, "", unsupported)
    parts = []
    if refused:
        parts.append("DeepSpeed features zerompi does not implement: " + "; ".join(refused))
    if unsupported:
        parts.append("unsupported DeepSpeed config keys: " + ", ".join(sorted(unsupported)))
    if parts:
        raise ConfigError("; ".join(parts))


def get(d: Mapping, dotted: str) -> tuple[bool, Any]:
    """(found, value) of the dotted key in nested mappings."""
    node: Any = d
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _parent(d: dict, dotted: str) -> tuple[dict | None, str]:
    *parents, leaf = dotted.split(".")
    node: Any = d
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _legacy_zero(d: dict) -> list[str]:
    """``"zero_optimization": true`` is stage 1 with ``allgather_size`` as its all-gather bucket
    (false: stage 0); ``allgather_size`` means nothing otherwise."""
    legacy, size = d.get("zero_optimization"), d.pop("allgather_size", _MISSING)
    if isinstance(legacy, bool):
        d["zero_optimization"] = {"stage": int(legacy)}
        if legacy and size is not _MISSING:
            d["zero_optimization"]["allgather_bucket_size"] = size
            return []
    if size is _MISSING:
        return []
    if not is_auto(size):
        real("allgather_size", size, ge=0)
    return ["allgather_size"]


def _dotted_top_level(d: dict) -> list[str]:
    """Top-level keys with dots in their names that name a key DeepSpeed has, such as the
    ``"zero_optimization.reduce_bucket_size"`` TRL's ``prepare_deepspeed`` writes for a reference model:
    DeepSpeed 0.19.8 reads nested keys only and ignores them, so they are accepted with no effect, as
    there. A dotted name DeepSpeed has no key for stays, to be refused as unknown."""
    aliases = {old for olds in ALIASES.values() for old in olds}
    ignored = []
    for key in [k for k in d if isinstance(k, str) and "." in k]:
        if _in_schema(key) or key in aliases:
            del d[key]
            ignored.append(f"{key!r} at the top level (DeepSpeed reads it nowhere)")
    return ignored


def _in_schema(dotted: str) -> bool:
    node: Any = SCHEMA
    for part in dotted.split("."):
        if isinstance(node, tuple):
            node = dict.fromkeys(node)
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _rename(d: dict, renamed: dict[str, str]) -> list[str]:
    """Old spellings to the key zerompi reads (recorded in ``renamed``); two spellings that differ are refused."""
    ignored = []
    for new, olds in ALIASES.items():
        block, leaf = _parent(d, new)
        for old in olds:
            old_block, old_leaf = _parent(d, old)
            if old_block is None or old_leaf not in old_block:
                continue
            value = old_block.pop(old_leaf)
            if leaf not in block:  # an old spelling's parent is its new spelling's parent
                block[leaf], renamed[new] = value, old
            elif new == "bf16":  # DeepSpeed reads bfloat16 only without bf16
                ignored.append(old)
            elif block[leaf] != value:
                raise ConfigError(f"{old}={value!r} and {new}={block[leaf]!r} are two spellings of one setting "
                                  "and differ; allowed: one of them")
    return ignored


def _cpu_offload(d: dict) -> None:
    """DeepSpeed's deprecated ``cpu_offload`` (``cpu_offload_param``): true is an offload_optimizer
    (offload_param) block with device 'cpu'; given beside that block DeepSpeed refuses it, and so does this."""
    zero = d.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    for old, block in _CPU_OFFLOAD.items():
        if old not in zero:
            continue
        dotted, value = f"zero_optimization.{old}", zero.pop(old)
        if is_auto(value):  # DeepSpeed drops "auto" here: the switch is left out
            continue
        on = boolean(dotted, value)
        if block in zero:
            raise ConfigError(f"{dotted} and zero_optimization.{block} are both given; {old} is DeepSpeed's old "
                              f"spelling of {block}; allowed: one of them ({block}.device='cpu' for {old}=true)")
        if on:
            zero[block] = {"device": "cpu"}


def _features(d: dict) -> list[str]:
    """'key (feature: reason)' for each enabled feature zerompi lacks; disabled blocks are removed."""
    refused = []
    for name, feature in FEATURES.items():
        if name == "data_efficiency" and isinstance(d.get(name), Mapping):
            refused += _data_efficiency(d.pop(name))
        elif name in d:
            where = _enabled_at(d.pop(name), feature, name)
            if where:
                refused.append(f"{where} ({feature.label}: {feature.reason})")
    optimizer = d.get("optimizer")
    kind = optimizer.get("type") if isinstance(optimizer, Mapping) else None
    if isinstance(kind, str) and kind.lower() in OPTIMIZER_FEATURES:
        feature = OPTIMIZER_FEATURES[kind.lower()]
        refused.append(f"optimizer.type={kind!r} ({feature.label}: {feature.reason})")
        del d["optimizer"]  # its params are that optimizer's, not unknown keys
    return refused


def _data_efficiency(block: Mapping) -> list[str]:
    """Each data-efficiency technique the block turns on, with its reason. As in DeepSpeed, a technique runs
    only under ``enabled: true`` at every level above it (the block's own switch is off by default), so a
    block that enables none of them changes nothing and is accepted."""
    if block.get("enabled") is not True:
        return []
    refused = []
    for path, (label, reason) in DATA_EFFICIENCY.items():
        node: Any = block
        for key in path.split("."):
            node = node.get(key) if isinstance(node, Mapping) else None
        parent_on = "." not in path or path.rsplit(".", 1)[0] in {p for p, _ in refused}
        if isinstance(node, Mapping) and node.get("enabled") is True and parent_on:
            refused.append((path, f"data_efficiency.{path}.enabled=True ({label}: {reason})"))
    # a technique's own entry says more than its gate's: keep a gate only when nothing under it is on
    named = [p for p, _ in refused]
    return [text for p, text in refused if not any(q.startswith(p + ".") for q in named)]


def _enabled_at(block: Any, feature: Feature, name: str) -> str | None:
    """None when the block is disabled, else the key (and value) that turns it on."""
    if not isinstance(block, Mapping):
        return f"{name}={block!r}"
    if "enabled" in block:
        return None if block["enabled"] is False else f"{name}.enabled={block['enabled']!r}"
    if name == "tensor_parallel":  # AutoTP is off at sizes 0 and 1
        sizes = [("autotp_size", block.get("autotp_size", 0))]
        sizes += [(f"{k}.tp_size", block[k].get("tp_size", 1)) for k in ("tp", "tensor_parallel")
                  if isinstance(block.get(k), Mapping)]
        on = [f"{name}.{k}={v!r}" for k, v in sizes if not (type(v) is int and v <= 1)]
        return on[0] if on else None
    if not feature.default_off:
        return name
    found = _enabled_inside(block, name)
    return f"{found}=True" if found else None


def _enabled_inside(block: Mapping, prefix: str) -> str | None:
    """The dotted path of the first ``enabled: true`` nested in ``block``, or None."""
    for key, value in block.items():
        if key == "enabled" and value is True:
            return f"{prefix}.enabled"
        if isinstance(value, Mapping):
            found = _enabled_inside(value, f"{prefix}.{key}")
            if found:
                return found
    return None


def _walk(block: Mapping, schema: Any, prefix: str, unsupported: list[str]) -> None:
    """Collect keys missing from ``schema`` as dotted paths; refuse non-mapping blocks."""
    if isinstance(schema, tuple):
        schema = dict.fromkeys(schema)
    for key, value in block.items():
        dotted = f"{prefix}{key}"
        if key not in schema:
            unsupported.append(f"{key!r} (a top-level key with dots in its name)" if not prefix and "." in key
                               else dotted)
        elif schema[key] is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{dotted}={value!r} is not an object with keys from: "
                                  + ", ".join(schema[key]))
            _walk(value, schema[key], dotted + ".", unsupported)
