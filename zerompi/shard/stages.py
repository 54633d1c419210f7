"""What each ZeRO stage shards and which collectives it runs: one table.

P = a bucket's padded numel, S = P / N its shard, c = compute dtype:

=====  ==============  ===============  =================  ================
stage  parameters (c)  fp32 master      gradients (c)      optimizer state
=====  ==============  ===============  =================  ================
0      full P          full P           full P             full P
1      full P          shard S          full P             shard S
2      full P          shard S          shard S            shard S
3      shard S         shard S          shard S            shard S
=====  ==============  ===============  =================  ================

Frozen parameters take no gradient, master or optimizer state: stages 0-2 keep
them replicated, stage 3 shards them in buckets of their own, which run stage 3's
row for their parameters; that a bucket trains is a value of its layout
(``BucketLayout.trainable``), not a row.

Every behaviour that differs between stages reads a field of :class:`StagePlan`
instead of comparing stage numbers where it lands.
"""
from __future__ import annotations

from typing import NamedTuple

from zerompi.config.choices import Rounds


class StagePlan(NamedTuple):
    """One row of the stage table."""

    stage: int
    shard_optimizer: bool
    """Master weights and optimizer state are this rank's shard (else every rank updates all)."""
    shard_grads: bool
    """Gradients are reduce-scattered into a shard after every micro-batch (else they accumulate
    in the full local buffer and are reduced once, at the end of the accumulation window)."""
    shard_params: bool
    """Parameters exist as a shard between uses; gather units all-gather them around forward and
    backward."""
    all_reduce_grads: bool
    """Gradients are all-reduced (as reduce-scatter + all-gather, so replicas stay bitwise equal)."""
    gather_after_step: bool
    """The updated shards are all-gathered into the full parameters right after the step."""

    @property
    def step_collectives(self) -> tuple[tuple[str, str], ...]:
        """(collective, 'weights' or 'grads') that one optimizer step runs over a bucket, each moving
        the bucket's (N-1)/N: stage 3 gathers the weights in forward and again in backward, then
        reduce-scatters the gradients; stages 1-2 reduce-scatter the gradients and gather the
        updated weights; stage 0 all-reduces the gradients as a reduce-scatter and an all-gather."""
        if self.shard_params:
            return ("all_gather", "weights"), ("all_gather", "weights"), ("reduce_scatter", "grads")
        if self.all_reduce_grads:
            return ("reduce_scatter", "grads"), ("all_gather", "grads")
        return ("reduce_scatter", "grads"), ("all_gather", "weights")


PLANS = {
    0: StagePlan(0, shard_optimizer=False, shard_grads=False, shard_params=False,
                 all_reduce_grads=True, gather_after_step=False),
    1: StagePlan(1, shard_optimizer=True, shard_grads=False, shard_params=False,
                 all_reduce_grads=False, gather_after_step=True),
    2: StagePlan(2, shard_optimizer=True, shard_grads=True, shard_params=False,
                 all_reduce_grads=False, gather_after_step=True),
    3: StagePlan(3, shard_optimizer=True, shard_grads=True, shard_params=True,
                 all_reduce_grads=False, gather_after_step=False),
}


def plan_for(stage: int, *, rounds: Rounds = Rounds.WINDOW) -> StagePlan:
    """The table row of ``stage`` (0-3; the config has validated it). With dealt ``rounds`` (micro_batches
    over the ranks) every round's gradient goes to its shard's owner after each backward, which
    is stage 2's gradient path; so stages 0 and 1 run stage 2's row (parameters stay whole on every
    rank, as at stages 0-1; gradients and optimizer state are sharded)."""
    return PLANS[max(int(stage), 2) if rounds.dealt else int(stage)]
