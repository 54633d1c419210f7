"""A bucket's communication, built once per bucket apart from its storage.

:class:`CommFactory` holds what every bucket's collectives depend on (the process groups, the
quantized codecs, the micro-batch rounds) and builds, for one bucket's layout and stage plan, its
parameter strategy and its gradient strategy (sync.py) together with what those own: the packed
weight and gradient codes, hpZ's node-local copy. The sharded model builds one per bucket and hands it,
with the bucket, to the bucket's collectives (collectives.py), which call the strategies' verbs; the
bucket keeps buffers and tiers and knows none of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zerompi.comm.group import ProcessGroup
from zerompi.comm.topology import Groups
from zerompi.config.choices import Rounds
from zerompi.offload.tiers import Resident
from zerompi.shard.compression import GradCodes, WeightCodes
from zerompi.shard.layout import BucketLayout
from zerompi.shard.placement import ParamPlacement
from zerompi.shard.stages import StagePlan
from zerompi.shard.sync import GradSync, ParamSync, grad_sync_for, param_sync_for


@dataclass(frozen=True)
class BucketComm:
    """One bucket's collectives."""

    param: ParamSync
    """How its parameters are gathered and published."""
    grad: GradSync | None
    """How its gradients reach their shard owners (None: a frozen bucket)."""
    weight_codes: WeightCodes | None
    """Quantized weights: this rank's packed shard, the source of gathers."""
    grad_codes: GradCodes | None
    """Quantized gradients: the codec and its error-feedback residual."""
    secondary: Resident | None
    """hpZ: this node's copy of the parameters, sharded within the node."""
    shard: ProcessGroup
    """The group its shards are spread over (whole values are gathered there for state dicts)."""


@dataclass(frozen=True)
class CommFactory:
    """Builds each bucket's :class:`BucketComm` from the groups, the config's policies and the codecs
    its parameters' placement records name."""

    groups: Groups
    error_feedback: bool = False
    """Quantized gradients keep what quantizing dropped, to add to the next reduction."""
    rounds: Rounds = Rounds.WINDOW
    """micro_batches: gradients reduced round by round (sync.py's SummedRounds, OrderedRounds)."""

    def build(self, layout: BucketLayout, plan: StagePlan, kind: ParamPlacement, rank: int, device: torch.device,
              params: torch.Tensor) -> BucketComm:
        """The collectives of the bucket ``layout`` running ``plan``, with the codecs its parameters'
        records ``kind`` name; ``params`` is its full compute-dtype parameters at build (the same on
        every rank)."""
        groups = self.groups
        hpz = groups.secondary is not None and plan.shard_params
        weight_codes = WeightCodes(kind.weight_codec, groups, layout, rank, params, hpz) \
            if kind.weight_codec is not None else None
        secondary = None
        if hpz and weight_codes is None:
            secondary = Resident(params[groups.secondary_block(layout.padded_numel)].clone())
        grad_codes, grad = None, None
        if layout.trainable:
            codec = kind.grad_codec
            grad_codes = None if codec is None else GradCodes(
                codec, groups.shard, layout.padded_numel, self.error_feedback, device)
            grad = grad_sync_for(plan, groups, layout, grad_codes, rounds=self.rounds)
        return BucketComm(param_sync_for(plan, groups, layout, weight_codes, secondary), grad, weight_codes,
                          grad_codes, secondary, groups.shard)
