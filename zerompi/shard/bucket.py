"""Bucket: the parameters that are communicated together, and their sharded state.

What a bucket holds persistently depends on the stage (P = padded numel,
S = P / world, c = compute dtype):

=====  ==============  ===============  =================  ================
stage  parameters (c)  fp32 master      gradients (c)      optimizer state
=====  ==============  ===============  =================  ================
0      full P          full P           full P             full P
1      full P          shard S          full P             shard S
2      full P          shard S          shard S            shard S
3      shard S         shard S          shard S            shard S
=====  ==============  ===============  =================  ================

In fp32 the master *is* the compute-dtype parameter (a view of it), so it
costs nothing extra, exactly as the ZeRO paper counts. Transient buffers
(stage 3's gathered parameters, stage 2/3's full gradient bucket during
backward) are allocated only while they are needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from zerompi.shard.buffer import FlatBuffer
from zerompi.dist.group import Work
from zerompi.errors import UsageError
from zerompi.shard.layout import BucketLayout


class BucketState(Enum):
    SHARDED = "sharded"    # stage 3 only: parameters exist as this rank's shard alone
    GATHERED = "gathered"  # the full parameters are in ``param_full``


@dataclass(frozen=True)
class Placement:
    """Where and how buckets live: stage, this rank, compute dtype, device."""

    stage: int
    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    check_finite: bool = False  # note which parameters get NaN/Inf gradients, to name them
    offload_optimizer: str = "none"  # 'cpu'/'nvme': the fp32 master lives in host memory (nvme: swapped)
    offload_params: str = "none"     # stage 3 'cpu': parameter shard in host memory ('nvme': ParamSwap)
    pin_memory: bool = False

    def host_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A host-memory copy of ``t`` (pinned when there is a GPU to copy to)."""
        out = t.detach().to("cpu", copy=True)
        return out.pin_memory() if self.pin_memory and torch.cuda.is_available() else out


def _done() -> Work:
    return Work()


class Bucket:
    """Flat parameter, master, gradient storage for one :class:`BucketLayout`.

    Args:
        layout: the frozen plan of this bucket.
        params: the module parameters of ``layout.slots``, in slot order; they
            are re-bound as views into this bucket's flat parameter buffer.
        where: stage, rank (in ``groups.shard``), dtype and device.
        init: the full padded fp32 initial values (identical on every rank).
        groups: the process groups (flat, HSDP or hpZ; see topology.py).
    """

    def __init__(self, layout: BucketLayout, params: list[torch.nn.Parameter], where: Placement,
                 init: torch.Tensor, groups):
        self.layout = layout
        self.params = params
        self.where = where
        self.groups = groups
        stage, dtype = where.stage, where.dtype
        more = " ..." if len(layout.slots) > 1 else ""
        self.name = f"bucket {layout.index} [{layout.slots[0].fqn}{more}]" + \
            (f" of module '{layout.unit or '<root>'}'" if stage >= 3 else "")
        self.nonfinite: list[str] = []  # parameters whose local gradient was NaN/Inf since the last step
        self._gather: Work | None = None   # a prefetch all-gather still in flight
        self._reduce: Work | None = None   # an overlapped reduce-scatter still in flight
        # Stage 0 "owns" the whole buffer: every rank updates every element.
        self.own = layout.shard(where.rank) if stage >= 1 else layout.full
        own = slice(self.own.start, self.own.stop)
        # A separate fp32 master unless the compute parameters already are one, in memory. On a
        # CPU device, 'cpu' offload has nowhere else to go: the shard is in host memory already.
        moved = {where.offload_optimizer, where.offload_params} - {"none"}
        if where.device.type == "cpu":
            moved.discard("cpu")
        self.separate = dtype != torch.float32 or bool(moved)

        self.param_full = FlatBuffer(layout.padded_numel, dtype, where.device)
        self.param_full.tensor.copy_(init)
        if stage >= 3:
            self.param_shard = self.param_full.tensor[own].clone()
            if where.offload_params != "none":
                self.param_shard = where.host_tensor(self.param_shard)
        else:
            self.param_shard = self.param_full.tensor[own]
        self.param_secondary = None  # hpZ: this node's copy of the parameters, sharded within the node
        if groups.secondary is not None:
            sec = layout.padded_numel // groups.gather.size
            self.param_secondary = self.param_full.tensor[groups.gather.rank * sec:(groups.gather.rank + 1) * sec].clone()
        # The master starts from the fp32 values, not from their rounded copy.
        self.master = init[own].clone() if self.separate else self.param_shard
        if where.offload_optimizer != "none" and self.separate:
            self.master = where.host_tensor(self.master)
        self.param_swap = None  # stage 3 offload_params='nvme': set by the sharded model
        # stages 2-3 offload_optimizer='nvme': the gradient shard lives in the swap file between
        # reductions, with its squared norm kept here for the step's clipping (set by offload)
        self.grad_swap = None
        self.grad_sq = 0.0
        self._grad_fresh = True  # the next reduction starts the shard (no read of stale zeros)

        self.grad_full = FlatBuffer(layout.padded_numel, dtype, where.device, zero=True,
                                    allocated=stage <= 1)
        if stage <= 1:
            self.grad_shard = self.grad_full.tensor[own]
        else:
            self.grad_shard = torch.zeros(self.own.numel, dtype=dtype, device=where.device)

        for p, slot in zip(params, layout.slots):
            p.data = self.param_full.view(slot.offset, slot.shape)
        self.state = BucketState.GATHERED
        if stage >= 3:
            self.reshard()
        self._ready: set[int] = set()
        # Slots whose gradient was written since the buffer was (re)started: the first gradient of
        # a slot is copied in, and what no gradient wrote is zeroed only before a reduction, which
        # saves zeroing the whole buffer first.
        self._written: set[int] = set()
        self._pending = False   # gradients added since the last reduction
        self._reduced = False   # reduced at least once in this backward


    # ---- parameters -------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> Work:
        """Stage 3: all-gather the shards (hpZ: the node's secondary shards) into the full buffer."""
        if self.state is BucketState.GATHERED:
            return _done()
        self.param_full.alloc()
        if self.param_secondary is not None:
            work = self.groups.gather.all_gather(self.param_secondary, self.param_full.tensor,
                                                 async_op=async_op, what=self.name)
        elif self.param_swap is not None:  # read the shard back from the swap file, gather, release it
            with self.param_swap.loaded() as shard:
                work = self.groups.gather.all_gather(shard, self.param_full.tensor, what=self.name)
        else:
            work = self.groups.gather.all_gather(self.param_shard, self.param_full.tensor,
                                                 async_op=async_op, what=self.name)
        self.state = BucketState.GATHERED
        if async_op:
            self._gather = work
        return work

    def prefetch(self) -> None:
        """Start what ``unshard()`` will wait on: a non-blocking all-gather, or, for a shard in the
        NVMe swap file, its read (the gather then runs when the unit needs it)."""
        if self.param_swap is not None and self.param_secondary is None:
            if self.state is BucketState.SHARDED:
                self.param_swap.prefetch()
        else:
            self.unshard(async_op=True)

    def wait_gathered(self) -> None:
        """Block until a prefetch all-gather into the parameters has landed."""
        if self._gather is not None:
            self._gather.wait()
            self._gather = None

    def progress(self) -> None:
        """Let MPI move this bucket's non-blocking collectives along (MPI_Test)."""
        for work in (self._gather, self._reduce):
            if work is not None:
                work.test()

    def reshard(self) -> None:
        """Stage 3: free the gathered parameters (views stay bound, storage is released)."""
        if self.where.stage < 3 or self.state is BucketState.SHARDED:
            return
        self.wait_gathered()  # MPI may still be writing into the buffer
        self.param_full.free()
        self.state = BucketState.SHARDED

    def publish(self) -> None:
        """After an optimizer step: bring the updated master into the compute parameters."""
        if self.param_swap is not None:
            with self.param_swap.loaded(load=False) as shard:
                shard.copy_(self.master)
                self._refresh_secondary(shard)
                self.param_swap.store()
            return
        if self.separate:
            self.param_shard.copy_(self.master)
        if self.where.stage in (1, 2):
            self.groups.gather.all_gather(None, self.param_full.tensor, what=self.name)
        self._refresh_secondary(self.param_shard)

    def _refresh_secondary(self, shard: torch.Tensor) -> None:
        if self.param_secondary is not None:  # hpZ: the one cross-node all-gather of parameters per step
            self.groups.secondary.all_gather(shard, self.param_secondary, what=self.name)

    # ---- gradients --------------------------------------------------------
    def begin_backward(self) -> None:
        self._ready.clear()
        self._reduced = False

    def add_grad(self, slot_index: int, grad: torch.Tensor) -> bool:
        """Accumulate one parameter's gradient; True once every slot has reported."""
        self.finish_reduce()  # a late gradient must not race an overlapped reduce-scatter of the buffer
        if self._reduced and self.where.stage <= 1:
            raise UsageError(
                f"parameter {self.layout.slots[slot_index].fqn!r} received a second gradient after its "
                "bucket was reduced in this backward (reentrant checkpointing of a shared parameter?); "
                "use torch.utils.checkpoint(..., use_reentrant=False) or ZeRO stage 2/3")
        if not self.grad_full.is_allocated:
            self.grad_full.alloc()
            self._written.clear()
        slot = self.layout.slots[slot_index]
        if self.where.check_finite and not _all_finite(grad):
            self.nonfinite.append(slot.fqn)
        dest = self.grad_full.view(slot.offset, slot.shape)
        if slot_index in self._written:
            dest.add_(grad)
        else:
            dest.copy_(grad)
            self._written.add(slot_index)
        self._ready.add(slot_index)
        self._pending = True
        return len(self._ready) == len(self.layout.slots)

    def needs_reduce(self) -> bool:
        """Every bucket is reduced once per synchronising backward, and again for late gradients."""
        return self._pending or not self._reduced

    def reduce_grads(self, *, async_op: bool = False) -> None:
        """Average this bucket's gradients over all ranks into the shard this rank owns.

        ``async_op`` (stages 1-3) only starts the reduce-scatter; ``finish_reduce`` applies it.
        """
        if not self.grad_full.is_allocated:  # no gradient reached this bucket: it reduces zeros
            self.grad_full.alloc()
            self._written.clear()
        full = self._zero_unwritten()
        stage, shard, n = self.where.stage, self.groups.shard, self.groups.world.size
        self._pending = False
        self._reduced = True
        if stage == 0:
            # reduce-scatter + all-gather = all-reduce, with bitwise identical replicas
            mine = self.layout.shard(shard.rank)
            reduced = shard.reduce_scatter(full, kind="all_reduce", what=self.name).wait()
            full[mine.start:mine.stop].copy_(reduced.div_(n))
            shard.all_gather(None, full, kind="all_reduce", what=self.name)
            return
        self._reduce = shard.reduce_scatter(full, what=self.name, async_op=async_op)
        if not async_op:
            self.finish_reduce()

    def _zero_unwritten(self) -> torch.Tensor:
        """Zero what no gradient wrote (padding, parameters without a gradient); the full buffer."""
        full, end = self.grad_full.tensor, 0
        for slot_index, slot in enumerate(self.layout.slots):  # in offset order
            if slot_index in self._written:
                full[end:slot.offset].zero_()
                end = slot.offset + slot.numel
        full[end:].zero_()
        self._written = set(range(len(self.layout.slots)))
        return full

    def finish_reduce(self) -> None:
        """Apply a started reduce-scatter: into the gradient shard, divided by the world size."""
        if self._reduce is None:
            return
        work, self._reduce = self._reduce, None
        reduced, n = work.wait(), self.groups.world.size
        if self.groups.replicate is not None:  # hsdp: sum the node's shard across nodes, in fp32
            self.groups.replicate.all_reduce(reduced, what=self.name)
        if self.where.stage == 1:
            self.grad_shard.copy_(reduced.div_(n))
        elif self.grad_swap is not None:
            self._accumulate_swapped(reduced.div_(n))
            self.grad_full.free()
        else:
            self.grad_shard.add_(reduced.div_(n))
            self.grad_full.free()

    def _accumulate_swapped(self, reduced: torch.Tensor) -> None:
        # The same arithmetic as the resident shard (zeros, then add), so results stay bitwise equal.
        with self.grad_swap.loaded(load=not self._grad_fresh) as shard:
            if self._grad_fresh:
                shard.zero_()
            shard.add_(reduced)
            self.grad_sq = float(torch.linalg.vector_norm(shard.to(torch.float32), dtype=torch.float32)) ** 2
            self.grad_swap.store()
        self._grad_fresh = False

    def master_grad(self) -> torch.Tensor:
        """This rank's reduced gradient in fp32, where the master lives (a view when it already is)."""
        if self.grad_swap is None:
            return self.grad_shard.to(self.master.device, torch.float32)
        if self._grad_fresh:  # no gradient since the last step
            return torch.zeros(self.own.numel, dtype=torch.float32, device=self.master.device)
        with self.grad_swap.loaded() as shard:
            return shard.to(self.master.device, torch.float32, copy=True)

    def zero_grad(self) -> None:
        if self.where.stage <= 1:
            self._written.clear()  # the next gradients overwrite; the rest is zeroed before reducing
        elif self.grad_swap is not None:
            self._grad_fresh, self.grad_sq = True, 0.0
        else:
            self.grad_shard.zero_()

    # ---- state ------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes held persistently: parameters, master (if separate), gradients."""
        stage = self.where.stage
        params = self.param_full.nbytes if stage <= 2 else _nbytes(self.param_shard)
        if self.param_secondary is not None:
            params += _nbytes(self.param_secondary)
        master = _nbytes(self.master) if self.separate else 0
        grads = self.grad_full.nbytes if stage <= 1 else _nbytes(self.grad_shard)
        return params + master + grads

    def full_master(self) -> torch.Tensor:
        """Collective: the full padded fp32 master of this bucket, on every rank."""
        if self.where.stage == 0:
            return self.master.detach().clone()
        out = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.master.device)
        self.groups.shard.all_gather(self.master.contiguous(), out, kind="state_dict", what=self.name)
        return out


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t``. A sum is one fast pass and is finite whenever every element is;
    only a non-finite sum (or finite values summing past the range) needs the elementwise
    check, which is about 40x slower on CPU."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _nbytes(t: torch.Tensor) -> int:
    """Bytes held; 0 for a tensor emptied into the swap file (its data is an empty tensor)."""
    return t.numel() * t.element_size()

