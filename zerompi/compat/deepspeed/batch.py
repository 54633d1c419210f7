"""DeepSpeed's three batch keys, completed and checked as DeepSpeed does once the world size is known.

``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world``:
given all three they must agree; given two, the third follows; given only one batch size,
accumulation is 1 (DeepSpeed 0.19.8, ``runtime/config.py``). The values are not ZeroConfig
fields (zerompi never sees a data loader) except accumulation, which becomes
``grad_accum_steps``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from zerompi.config.checks import integer
from zerompi.errors import ConfigError

TRAIN, MICRO, ACCUM = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


class BatchKeys(NamedTuple):
    """The batch keys a config gives (None: left out or "auto")."""

    train: int | None
    micro: int | None
    accum: int | None


class Batch(NamedTuple):
    """The completed batch sizes of one run (None: the config gives no batch size at all)."""

    train: int | None
    micro: int | None
    accum: int


def read_batch_keys(doc: Mapping[str, Any]) -> BatchKeys:
    """The batch keys of a resolved document (no "auto" left), each an int >= 1 or None."""
    def get(key: str) -> int | None:
        value = doc.get(key)
        return None if value is None else integer(key, value, 1)
    return BatchKeys(get(TRAIN), get(MICRO), get(ACCUM))


def complete_batch(keys: BatchKeys, world: int) -> Batch:
    """Fill in what DeepSpeed derives; ConfigError naming the keys when they disagree."""
    train, micro, accum = keys
    if train is not None and micro is not None and accum is None:
        accum = train // micro // world
    elif train is not None and accum is not None and micro is None:
        micro = train // world // accum
    elif train is None and micro is not None:
        train = micro * (accum or 1) * world
    elif train is not None and micro is None:
        micro = train // world
    accum = accum or 1
    if train is not None and (micro < 1 or train != micro * accum * world):
        given = ", ".join(f"{k}={v}" for k, v in zip((TRAIN, MICRO, ACCUM), keys) if v is not None)
        raise ConfigError(f"{given} disagree on {world} ranks: {TRAIN} must equal {MICRO} * {ACCUM} * world size "
                          f"({micro} * {accum} * {world} = {micro * accum * world}, not {train}); allowed: "
                          "values that satisfy it, or leave one of them out to have it derived")
    return Batch(train, micro, accum)
