"""``optimizer="muon"``: Muon on the hidden matrices, AdamW on everything else, as large runs train.

The rule (docs/getting-started.md states it too): a parameter goes to Muon when it is 2-D, trainable, not an
``nn.Embedding``'s weight nor tied to one, and not the output head's (a module whose name ends in
``lm_head``, ``head``, ``output`` or ``classifier``). Embeddings, the head, biases and norms go to AdamW.
Muon takes the config's ``lr`` and ``weight_decay`` with ``adjust_lr_fn="match_rms_adamw"`` (Moonlight's
scaling, which gives Muon's update AdamW's RMS so that one learning rate and decay serve both: Liu et al.
2025, "Muon is Scalable for LLM Training"), and ``optimizer_kwargs`` for its other options (momentum,
nesterov, ns_steps, ...); AdamW takes the config's ``lr``, ``betas``, ``eps`` and ``weight_decay``.

Param groups given to ``initialize`` are each cut in two by the rule, each half keeping the group's options
that its optimizer takes; a group that names its own optimizer is left as it is.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerompi.config.sections import OptimizerPolicy
from zerompi.optim.kinds import group_keys

NAME = "muon"
HEADS = ("lm_head", "head", "output", "classifier")
"""Last name components of the modules taken for the output head."""


def muon_parameters(module: nn.Module) -> set[int]:
    """The ids of the parameters the rule gives to Muon."""
    embedded = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    heads = {id(p) for name, m in module.named_modules() if name.rpartition(".")[2] in HEADS
             for p in m.parameters(recurse=False)}
    return {id(p) for p in module.parameters()
            if p.requires_grad and p.dim() == 2 and id(p) not in embedded and id(p) not in heads}


def expand(module: nn.Module, param_groups: list[dict[str, Any]] | None,
           policy: OptimizerPolicy) -> list[dict[str, Any]] | None:
    """The param groups the engine builds: ``muon_groups`` for ``optimizer="muon"``, else as given."""
    return muon_groups(module, param_groups, policy) if policy.optimizer == NAME else param_groups


def muon_groups(module: nn.Module, param_groups: list[dict[str, Any]] | None,
                policy: OptimizerPolicy) -> list[dict[str, Any]]:
    """The param groups of ``optimizer="muon"``: each group (every trainable parameter when none is
    given) cut into a Muon half and an AdamW half by the rule, with explicit optimizers and options."""
    muon = {"optimizer": torch.optim.Muon, "lr": policy.lr, "weight_decay": policy.weight_decay,
            "adjust_lr_fn": "match_rms_adamw", **policy.kwargs}
    adamw = {"optimizer": torch.optim.AdamW, "lr": policy.lr, "betas": tuple(policy.betas), "eps": policy.eps,
             "weight_decay": policy.weight_decay}
    given = param_groups or [{"params": [p for p in module.parameters() if p.requires_grad]}]
    chosen, out = muon_parameters(module), []
    either = group_keys(torch.optim.Muon) | group_keys(torch.optim.AdamW)
    for group in given:
        if "optimizer" in group:
            out.append(group)
            continue
        params = list(group["params"])
        options = {k: v for k, v in group.items() if k != "params"}
        for base, mine in ((muon, [p for p in params if id(p) in chosen]),
                           (adamw, [p for p in params if id(p) not in chosen])):
            if mine:
                takes = group_keys(base["optimizer"])  # a key neither takes stays, and is refused by name
                kept = {k: v for k, v in options.items() if k in takes or k not in either}
                out.append({**base, **kept, "params": mine})
    return out
