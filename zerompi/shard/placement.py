"""Where each parameter lives: one record per parameter, decided once, before any bucket is built.

A parameter is *sharded* (stage 3: a shard in a bucket of its gather unit, gathered
around use), *gathered* (in a bucket, whole on every rank: stages 0-2, and stage 3's
trainable parameters below ``param_persistence_threshold``) or *replicated* (no bucket:
a frozen parameter held whole, as buffers are). Trainable and frozen are an attribute of
the record, not a separate path: the bucket builder, deferred initialisation and the
checkpoint's list of whole frozen tensors all read the same records (``place``), so the
persistence threshold is compared in one place.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from torch import nn

from zerompi.comm.codec import BlockCodec
from zerompi.config.choices import Offload
from zerompi.errors import UsageError
from zerompi.shard.compression import Compression
from zerompi.shard.layout import ParamSpec
from zerompi.shard.stages import StagePlan, plan_for


class Residence(Enum):
    """How a parameter is held between uses."""

    SHARDED = "sharded"        # stage 3: this rank's shard, in a bucket of its gather unit
    GATHERED = "gathered"      # whole on every rank, in a bucket (its master and gradient may be sharded)
    REPLICATED = "replicated"  # whole on every rank, outside any bucket (frozen parameters only)


@dataclass(frozen=True)
class ParamPlacement:
    """One parameter's placement: its residence, whether it trains, its optimizer group, tier and codecs.
    Complete when made; what the bucket planner decides from it (a gather unit, an owning rank) is recorded
    beside it (ShardedModel.unit_of, .owners), never written into it."""

    fqn: str
    shape: tuple[int, ...]
    trainable: bool
    residence: Residence
    group: int = 0
    """Optimizer param group (frozen parameters: 0); buckets never mix groups."""
    tier: Offload = Offload.NONE
    """Where its parameter shard lives between uses (``offload_params``): sharded parameters only; the
    others are held where they compute (offload/tiers.py places the shard as this says)."""
    weight_codec: BlockCodec | None = None
    """How its values travel in its bucket's gathers (``quantize_weights``): where the bucket gathers
    parameters (stage 3, or after the step); the bucket's collectives take it (shard/wiring.py)."""
    grad_codec: BlockCodec | None = None
    """How its gradient travels in reductions (``quantize_grads``): trainable parameters only."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def sharded(self) -> bool:
        return self.residence is Residence.SHARDED

    @property
    def bucketed(self) -> bool:
        return self.residence is not Residence.REPLICATED

    def bucket_kind(self) -> "ParamPlacement":
        """What a bucket's parameters share (all but name and shape): one bucket, one kind."""
        return dataclasses.replace(self, fqn="", shape=())

    @property
    def spec(self) -> ParamSpec:
        """What the bucket planner needs (layout.py)."""
        return ParamSpec(self.fqn, self.shape, self.group)

    def bucket_plan(self, stage: StagePlan) -> StagePlan:
        """The stage-table row its bucket runs: a trainable parameter kept whole at stage 3 is bucketed
        as at stage 2; a frozen one is bucketed only when sharded (stage 3), and its bucket's layout
        says that it does not train."""
        if stage.shard_params and not self.sharded:
            return plan_for(2)
        return stage


def place(params: Iterable[tuple[str, tuple[int, ...], bool]], stage: StagePlan, persistence_threshold: int,
          group_of: Mapping[str, int], offload_params: Offload = Offload.NONE,
          compression: Compression = Compression()) -> list[ParamPlacement]:
    """The placement of each ``(fqn, shape, requires_grad)``, in the order given.

    Stage 3 shards every parameter of at least ``persistence_threshold`` elements, trainable or
    frozen; below it, trainable ones stay gathered and frozen ones replicated. Stages 0-2 keep
    trainable parameters gathered and frozen ones replicated. ``group_of``: optimizer group of
    each trainable parameter's fqn; ``offload_params``: the tier of sharded parameters; ``compression``:
    the config's codecs, recorded where they apply."""
    out = []
    for fqn, shape, trainable in params:
        if stage.shard_params and math.prod(shape) >= persistence_threshold:
            residence = Residence.SHARDED
        else:
            residence = Residence.GATHERED if trainable else Residence.REPLICATED
        placed = ParamPlacement(fqn, tuple(shape), trainable, residence, group_of[fqn] if trainable else 0)
        plan = placed.bucket_plan(stage)
        gathered_by_bucket = placed.bucketed and (plan.shard_params or plan.gather_after_step)
        out.append(dataclasses.replace(
            placed, tier=offload_params if placed.sharded else Offload.NONE,
            weight_codec=compression.weights if gathered_by_bucket else None,
            grad_codec=compression.grads if trainable else None))
    return out


def optimizer_groups(module: nn.Module, param_groups) -> tuple[dict[nn.Parameter, int], list[dict]]:
    """Map each trainable parameter to an optimizer group index, and each group's options."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not param_groups:
        return {p: 0 for p in trainable}, [{}]
    membership: dict[nn.Parameter, int] = {}
    options = []
    for gi, spec in enumerate(param_groups):
        if not isinstance(spec, dict) or "params" not in spec:
            raise UsageError(f"param_groups[{gi}] must be a dict with a 'params' list")
        for p in spec["params"]:
            if p in membership:
                raise UsageError(f"a parameter appears in param_groups {membership[p]} and {gi}")
            membership[p] = gi
        options.append({k: v for k, v in spec.items() if k != "params"})
    missing = [p for p in trainable if p not in membership]
    if missing:
        raise UsageError(f"{len(missing)} trainable parameters are in no param group")
    return membership, options
