"""Cutting a module into buckets (and, at stage 3, gather units) from its parameters' placements.

Stages 0-2 bucket the gathered parameters by size, in reverse registration order (about the
order backward produces their gradients). Stage 3 also picks gather units and plans each unit's
sharded parameters as buckets of their own, trainable and frozen ones apart (numbered apart too,
as checkpoints number them), so that a model built on the meta device is materialised one unit
at a time.
"""
from __future__ import annotations

import logging

from torch import nn

from zerompi.log import get_logger, log_rank0
from zerompi.shard.layout import BucketLayout, choose_units, common_ancestor, descent, plan_buckets
from zerompi.shard.placement import ParamPlacement, Residence
from zerompi.shard.stages import StagePlan
from zerompi.shard.units import Unit, owners_of


def plan_layouts(module: nn.Module, placed: list[ParamPlacement], stage: StagePlan, world: int, cap: int,
                 align: int = 1, whole: frozenset[int] = frozenset()) -> tuple[list[BucketLayout], list[Unit],
                                                                         dict[str, str]]:
    """(every bucket's layout in build order, stage 3's units, each sharded parameter's unit). ``whole``:
    optimizer groups whose buckets are owner-aligned where the optimizer state is sharded (stages 1-3)."""
    whole = whole if stage.shard_optimizer else frozenset()  # stage 0: every rank updates every tensor
    gathered = [pl.spec for pl in reversed(placed) if pl.residence is Residence.GATHERED]
    loads: dict[int, list[int]] = {}  # each whole-tensor group's per-rank load, over all its buckets
    layouts = plan_buckets(gathered, world, cap, align=align, whole=whole, loads=loads)
    units: list[Unit] = []
    unit_of_param: dict[str, str] = {}
    if not stage.shard_params:
        return layouts, units, unit_of_param
    named = [(pl, module.get_parameter(pl.fqn)) for pl in placed if pl.sharded]
    owners = owners_of(module, [p for _, p in named])
    modules = dict(module.named_modules())
    own_numel: dict[str, int] = {}
    for p, owner in owners.items():
        own_numel[owner] = own_numel.get(owner, 0) + p.numel()
    runs = {n for n, m in modules.items() if type(m).forward is not nn.Module.forward}
    unit_of = choose_units(list(modules), own_numel, cap, runs)
    counts = {True: len(layouts), False: 0}  # trainable, frozen buckets so far
    for fqn in modules:
        if unit_of[fqn] != fqn:
            continue
        mine = [(pl, p) for pl, p in named if unit_of[owners[p]] == fqn]
        for trainable in (True, False):
            specs = [pl.spec for pl, _ in mine if pl.trainable == trainable]
            if specs:
                new = plan_buckets(specs, world, 2**62, first_index=counts[trainable], unit=fqn, align=align,
                                   whole=whole if trainable else frozenset(), loads=loads, trainable=trainable)
                counts[trainable] += len(new)
                layouts += new
        unit_of_param.update((pl.fqn, fqn) for pl, _ in mine)
        if mine:
            inner = descent(fqn, common_ancestor([owners[p] for _, p in mine]))
            entries = [modules[fqn]] + [modules[m] for m in inner if m in runs]
            units.append(Unit(fqn, modules[fqn], entries))
    return layouts, units, unit_of_param


def log_plan(stage: int, buckets: list[tuple[BucketLayout, bool]], world_size: int) -> None:
    """Rank 0 logs the bucket plan once (INFO): each bucket's unit, parameters and sizes."""
    logger = get_logger(__name__)
    if not logger.isEnabledFor(logging.INFO):
        return
    rows = [f"  {'bucket' if trains else 'frozen'} {b.index:3d} unit={b.unit or '-':20s} params={len(b.slots):3d} "
            f"numel={b.numel} padded={b.padded_numel} shard={b.shard_numel}" for b, trains in buckets]
    log_rank0(logger, logging.INFO, "stage %d, %d buckets (%d frozen) on %d ranks:\n%s", stage, len(buckets),
              sum(not trains for _, trains in buckets), world_size, "\n".join(rows))
