"""What crosses the network for a bucket, and when: its collectives, their work in flight and the state of its
parameters, apart from the bucket's storage.

A :class:`~zerompi.shard.bucket.Bucket` holds buffers, tiers, the master and the gradient shard, and builds
nothing. :class:`BucketCollectives` is handed a bucket and the strategies built for it (wiring.py's
``BucketComm``) and drives them: gather and release the parameters (stage 3), publish them after a step,
reduce the gradients and apply the reduction, gather whole values for a state dict. It keeps the work
handles and the SHARDED / GATHERING / GATHERED state, whose transitions it checks. A stage-3 gather unit
(units.py) drives its buckets' collectives together. Megatron-Core splits ``_ParamAndGradBucket`` (data)
from ``_ParamAndGradBucketGroup`` (the sync verbs) in the same way.
"""
from __future__ import annotations

from enum import Enum

import torch

from zerompi.comm.group import ProcessGroup, Work
from zerompi.errors import UsageError, ZeroMPIError
from zerompi.shard.bucket import Bucket
from zerompi.shard.compression import GradCodes, WeightCodes
from zerompi.shard.wiring import BucketComm


class BucketState(Enum):
    """Where the bucket's parameters are. Stages 0-2 are always GATHERED."""

    SHARDED = "sharded"      # stage 3: only this rank's shard exists
    GATHERING = "gathering"  # stage 3: a non-blocking all-gather into the full buffer is in flight
    GATHERED = "gathered"    # the full parameters are in the bucket's ``param_full``


class BucketCollectives:
    """The collectives of one bucket and their state (module docstring).

    Args:
        bucket: the storage they read and write.
        comm: its parameter and gradient strategies, codes and hpZ copy (wiring.py), built for it.
    """

    def __init__(self, bucket: Bucket, comm: BucketComm):
        self.bucket, self.comm = bucket, comm
        self.name, self.plan = bucket.name, bucket.plan
        self.param_sync, self.grad_sync = comm.param, comm.grad  # grad_sync: None for a frozen bucket
        self._gather: Work | None = None   # a non-blocking all-gather in flight (GATHERING)
        self._reduce: Work | None = None   # an overlapped reduce-scatter in flight
        self._ready: set[int] = set()      # slots whose gradient arrived in this backward
        self._pending = False   # gradients added since the last reduction
        self._reduced = False   # reduced at least once in this backward
        if comm.weight_codes is not None and not self.plan.shard_params:  # stages 1-2 compute with decoded values
            comm.weight_codes.decode_all(bucket.param_full.tensor)
        self.state = BucketState.GATHERED
        if self.plan.shard_params:
            self.reshard()

    @property
    def weight_codes(self) -> WeightCodes | None:
        return self.comm.weight_codes

    @property
    def grad_codes(self) -> GradCodes | None:
        return self.comm.grad_codes

    @property
    def shard_group(self) -> ProcessGroup:
        return self.comm.shard

    def _illegal(self, verb: str, allowed: str) -> ZeroMPIError:
        return ZeroMPIError(f"{self.name}: {verb} in state {self.state.name} (allowed from {allowed})")

    # ---- parameters -------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> Work:
        """Stage 3: SHARDED -> GATHERED (blocking) or GATHERING (``async_op``). A bucket already
        gathered or gathering has nothing to start: its in-flight gather, if any, is returned."""
        if self.state is not BucketState.SHARDED:
            return self._gather if self._gather is not None else Work.done()
        b = self.bucket
        b.open_params()
        source = self.param_sync.source(b.param_tier)
        async_op = async_op and (source is None or source.stays_resident)  # a swapped shard is gone after its block
        work = self.param_sync.gather(b.param_tier, b.param_full.tensor, async_op=async_op, what=self.name)
        if async_op:
            self._gather, self.state = work, BucketState.GATHERING
        else:
            self.state = BucketState.GATHERED
        return work

    def prefetch(self) -> None:
        """Start what ``unshard()`` will wait on: a non-blocking all-gather, or, for a shard in the
        swap file, its read (the gather then runs when the unit needs it)."""
        source = self.param_sync.source(self.bucket.param_tier)
        if source is None or source.stays_resident:
            self.unshard(async_op=True)
        elif self.state is BucketState.SHARDED:
            source.prefetch()

    def wait_gathered(self) -> None:
        """GATHERING -> GATHERED: block until the all-gather has landed (GATHERED: nothing to do)."""
        if self.state is BucketState.SHARDED:
            raise self._illegal("wait_gathered()", "GATHERING or GATHERED: no gather was started")
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
        self.state = BucketState.GATHERED

    def progress(self) -> None:
        """Let MPI move this bucket's non-blocking collectives along (MPI_Test)."""
        for work in (self._gather, self._reduce):
            if work is not None:
                work.test()

    def reshard(self) -> None:
        """Stage 3: GATHERING/GATHERED -> SHARDED, freeing the gathered parameters (an in-flight gather is
        waited for first, since MPI may still be writing). Idempotent; stages 0-2 keep their parameters whole."""
        if not self.plan.shard_params or self.state is BucketState.SHARDED:
            return
        self.wait_gathered()
        self.bucket.close_params()
        self.state = BucketState.SHARDED

    def publish(self) -> None:
        """After an optimizer step: bring the updated master into the compute parameters."""
        if self.plan.shard_params and self.state is not BucketState.SHARDED:
            raise self._illegal("publish()", "SHARDED: the step runs between backward and forward")
        b = self.bucket
        if b.param_tier.reads_master and not self.param_sync.publishes:
            return  # the next gather reads the master's region, which the step writes
        with b.param_tier.loaded(load=False) as shard:
            if b.separate:
                shard.copy_(b.master)
            self.param_sync.publish(shard, b.param_full.tensor, self.name)
            b.param_tier.store()

    # ---- gradients --------------------------------------------------------
    def begin_backward(self) -> None:
        self._ready.clear()
        self._reduced = False

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> bool:
        """Accumulate one parameter's gradient into the bucket; True once every slot has reported."""
        self.finish_reduce()  # a late gradient must not race an overlapped reduce-scatter of the buffer
        b = self.bucket
        if self._reduced and not self.plan.shard_grads:
            raise UsageError(
                f"parameter {b.layout.slots[slot_index].fqn!r} received a second gradient after its "
                "bucket was reduced in this backward (reentrant checkpointing of a shared parameter?); "
                "use torch.utils.checkpoint(..., use_reentrant=False) or ZeRO stage 2/3")
        b.write_grad(slot_index, grad)
        self._ready.add(slot_index)
        self._pending = True
        return len(self._ready) == len(b.layout.slots)

    def needs_reduce(self) -> bool:
        """Every bucket is reduced once per synchronising backward, and again for late gradients."""
        return self._pending or not self._reduced

    def reduce_grads(self, *, async_op: bool = False, taken_next: bool = False, sources: int | None = None) -> None:
        """Average the bucket's gradients over all ranks into the shard this rank owns.

        ``async_op`` (stages 1-3) only starts the reduce-scatter; ``finish_reduce`` applies it.
        ``taken_next``: the optimizer updates this bucket right after (GradShard.write).
        ``sources`` (micro_batches): a round, after each backward and for each round this rank ran no
        micro-batch in (nothing written), in which the first ``sources`` ranks ran one: its gradients are
        added to the shard (SummedRounds; reproducible=True: in rank order, OrderedRounds).
        """
        full = self.bucket.grads_to_reduce()
        self._pending = False
        self._reduced = True
        work = self.grad_sync.start(full, async_op=async_op, what=self.name, sources=sources)
        if self.grad_sync.in_place:
            self.bucket.grads.filled_in_place()  # the shard is the whole buffer, reduced in place
            return
        self._reduce = work
        if not async_op:
            self.finish_reduce(taken_next=taken_next)

    def finish_reduce(self, *, taken_next: bool = False) -> None:
        """Apply a started reduce-scatter: into the gradient shard, divided by the world size
        (``taken_next``: see reduce_grads)."""
        if self._reduce is None:
            return
        work, self._reduce = self._reduce, None
        self.bucket.take_reduced(self.grad_sync.finish(work, self.name), self.grad_sync.per_micro_batch, taken_next)

    # ---- whole values and loads -------------------------------------------------
    def full_master(self) -> torch.Tensor:
        """Collective: the full padded fp32 master of this bucket, on every rank (a frozen bucket's
        parameters, widened to fp32)."""
        b = self.bucket
        if not b.trains:
            return self.full_params().float()
        if not self.plan.shard_optimizer:
            return b.master.detach().clone()
        out = torch.empty(b.layout.padded_numel, dtype=torch.float32, device=b.master.device)
        self.comm.shard.all_gather(b.master.contiguous(), out, kind="state_dict", what=self.name)
        return out

    def full_params(self) -> torch.Tensor:
        """Collective (stage 3): the full padded compute-dtype parameters, gathered from the shards
        into a new tensor (the bucket stays SHARDED)."""
        b = self.bucket
        out = torch.empty(b.layout.padded_numel, dtype=b.storage.dtype, device=b.storage.device)
        with b.param_tier.loaded() as shard:
            self.comm.shard.all_gather(shard, out, kind="state_dict", what=self.name)
        return out

    def load_params(self, shard: torch.Tensor) -> None:
        """Overwrite a frozen bucket's parameter shard (a checkpoint load); collective under hpZ,
        whose node-local copy is rebuilt from the new shards."""
        b = self.bucket
        if b.trains or self.state is not BucketState.SHARDED:
            raise self._illegal("load_params()", "SHARDED, on a frozen bucket")
        with b.param_tier.loaded(load=False) as mine:
            mine.copy_(shard)  # then to where gathers read: the packed shard, hpZ's node copy
            self.param_sync.publish(mine, b.param_full.tensor, self.name)
            b.param_tier.store()

    def state_bytes(self) -> int:
        """Bytes held persistently in memory: the bucket's, and the packed codes and hpZ copy of its collectives."""
        extra = self.comm.secondary.nbytes if self.comm.secondary is not None else 0
        if self.bucket.trains:
            extra += sum(c.nbytes for c in (self.comm.weight_codes, self.comm.grad_codes) if c is not None)
        return self.bucket.state_bytes() + extra
