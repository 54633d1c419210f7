"""``"optimizer": {"type": "Muon"}`` with DeepSpeed 0.19.8's meaning: Muon on the tagged matrices,
Adam(W) on the rest, as param groups of the engine.

What DeepSpeed does (``deepspeed.set_optimizer_flags``, ``DeepSpeedEngine._muon_param_groups``):

* ``initialize`` tags *every* parameter of the model, overwriting a tag the script set:
  ``use_muon`` is true for a tensor of 2 or more dims whose name has neither "embed" nor
  "lm_head" (lower case). A parameter of ``model_parameters`` that is not the model's keeps
  its own tag and must have one.
* each incoming param group is cut into a Muon half (trainable tagged parameters) and an Adam
  half (the other trainable ones); settings resolve config value, then ``muon_lr`` /
  ``adam_lr``, then the group's own keys. The Muon half takes lr, momentum, weight_decay and
  ns_method (defaults 0.02, 0.95, 0, "gram"), the Adam half lr, betas, eps and weight_decay
  (defaults 3e-4, (0.9, 0.95), 1e-10, 0); other group keys are dropped there and refused here.
* the Adam half is AdamW (``adam_w_mode``, true by default) or Adam with L2 decay.

Here the Muon half runs ops/muon.py's :class:`Muon` as the group's own optimizer (whole tensors,
on their owner ranks) and the Adam half the config's optimizer, torch's AdamW or Adam with those
defaults. What DeepSpeed does differently, and zerompi cannot follow, is refused (:func:`check`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from zerompi.compat.deepspeed.keys import MUON_PARAMS
from zerompi.compat.deepspeed.ops.muon import NS_METHODS, Muon
from zerompi.config.checks import boolean
from zerompi.config.zero import CHECKS
from zerompi.errors import ConfigError, UsageError

__all__ = ["MUON_PARAMS", "MuonSettings", "check", "is_muon", "param_groups", "read", "tag"]

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
_ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


class MuonSettings(NamedTuple):
    """The config's settings of each half, DeepSpeed's defaults filled in."""

    muon: dict[str, Any]
    adam: dict[str, Any]


def is_muon(kind: Any) -> bool:
    return isinstance(kind, str) and kind.lower() == "muon"


def read(params: Mapping[str, Any], kwargs: dict[str, Any]) -> MuonSettings:
    """The two halves' settings from ``optimizer.params``; ``kwargs`` gets the Adam half as the config's
    optimizer (ConfigError naming a key DeepSpeed's Muon does not read, or one zerompi cannot honour)."""
    wrong = sorted(f"optimizer.params.{k}" for k in params if k not in MUON_PARAMS)
    if wrong:
        raise ConfigError(f"{', '.join(wrong)} do(es) not apply to optimizer.type='Muon' (DeepSpeed 0.19.8's "
                          f"Muon ignores them); allowed params: {', '.join(MUON_PARAMS)}")
    if boolean("optimizer.params.per_head_muon", params.get("per_head_muon", False)):
        raise ConfigError("optimizer.params.per_head_muon=true is not supported: zerompi orthogonalises each "
                          "matrix whole, not per attention head; allowed: false")
    if "torch_adam" in params:
        boolean("optimizer.params.torch_adam", params["torch_adam"])
    halves = []
    for keys, defaults, own_lr in ((MUON_KEYS, _MUON_DEFAULTS, "muon_lr"), (ADAM_KEYS, _ADAM_DEFAULTS, "adam_lr")):
        half = dict(defaults)
        half.update({k: params[k] for k in keys if k in params})
        if own_lr in params:
            half["lr"] = params[own_lr]
        halves.append(half)
    muon, adam = halves
    for k in ("lr", "momentum", "weight_decay"):
        muon[k] = CHECKS[k](f"optimizer.params.{'muon_lr' if k == 'lr' else k}", muon[k])
    if muon["ns_method"] not in NS_METHODS:
        raise ConfigError(f"optimizer.params.ns_method={muon['ns_method']!r} is not one of {', '.join(NS_METHODS)}")
    for k in ADAM_KEYS:
        adam[k] = CHECKS[k](f"optimizer.params.{'adam_lr' if k == 'lr' else k}", adam[k])
    w_mode = boolean("optimizer.params.adam_w_mode", params.get("adam_w_mode", True))
    kwargs.update(optimizer="adamw" if w_mode else "adam", **adam)
    return MuonSettings(muon, adam)


def tag(model: nn.Module) -> None:
    """DeepSpeed's tags on every parameter of ``model`` (see the module docstring)."""
    for name, p in model.named_parameters():
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)
        p.use_muon = len(shape) >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def _tags(model: nn.Module, groups: list[dict[str, Any]]) -> dict[int, bool]:
    tag(model)
    tags = {id(p): p.use_muon for p in model.parameters()}
    missing = 0
    for g in groups:
        for p in g["params"]:
            if id(p) not in tags:
                if not hasattr(p, "use_muon"):
                    missing += 1
                else:
                    tags[id(p)] = bool(p.use_muon)
    if missing:
        raise UsageError(f"optimizer.type='Muon' needs every parameter tagged with use_muon, and {missing} of "
                         "model_parameters are not the model's and untagged: set p.use_muon = True/False on them "
                         "(DeepSpeed refuses them too)")
    return tags


def param_groups(model: nn.Module, groups: list[dict[str, Any]] | None,
                 settings: MuonSettings) -> list[dict[str, Any]]:
    """Each group (every parameter of ``model`` when None) cut into its Muon and Adam halves; the Muon
    half runs :class:`Muon` as its own optimizer, the Adam half the config's optimizer."""
    groups = groups if groups is not None else [{"params": list(model.parameters())}]
    tags = _tags(model, groups)
    out = []
    for i, g in enumerate(groups):
        own = {k: v for k, v in g.items() if k not in ("params", "name")}
        unknown = sorted(k for k in own if k not in MUON_KEYS + ADAM_KEYS)
        if unknown:
            raise UsageError(f"model_parameters[{i}] sets {', '.join(map(repr, unknown))}, which neither half of "
                             f"DeepSpeed's Muon reads (it drops them); allowed: {', '.join(MUON_KEYS + ADAM_KEYS)}")
        trainable = [p for p in g["params"] if p.requires_grad]
        muon = [p for p in trainable if tags[id(p)]]
        adam = [p for p in trainable if not tags[id(p)]]
        if muon:
            out.append({**settings.muon, **{k: v for k, v in own.items() if k in MUON_KEYS},
                        "params": muon, "optimizer": Muon})
        if adam:
            out.append({**{k: v for k, v in own.items() if k in ADAM_KEYS}, "params": adam})
    return out


def check(stage: int, clip: float | None, dtype: torch.dtype) -> None:
    """Refuse what DeepSpeed's Muon does that zerompi's engine does not (UsageError naming the key)."""
    if stage >= 1 and clip:
        raise UsageError(f"gradient_clipping={clip:g} with optimizer.type='Muon' at ZeRO stage {stage}: DeepSpeed "
                         "0.19.8 clips there by the norm of the Muon half's orthogonalised updates together with "
                         "the Adam half's gradients, zerompi clips the gradients before the optimizer (as "
                         "DeepSpeed does at stage 0); allowed: 0 (DeepSpeed's default is 1.0, so set it)")
    if dtype != torch.float32:
        raise UsageError("bf16.enabled/fp16.enabled with optimizer.type='Muon': zerompi's Muon has been compared "
                         "with DeepSpeed's in fp32 only; allowed: fp32 training")
