"""zerompi.shard.bucket.Bucket and its collectives (shard/collectives.py) on a world of one (MPI.COMM_SELF),
built as shard/sharded.py builds them.

Each verb is checked for its state afterwards, the values it leaves, and the collectives it
issues (recorded by ``Recording``). On one rank a reduction divides by 1, so the reduced
gradient must equal the local one exactly. The sequences a bucket should never see are
pinned: an illegal transition raises naming the verb and the state; the no-ops left are the
idempotent ones (a second reshard, unshard of a gathered bucket).
"""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

from zerompi.comm.mpi import MPIGroup
from zerompi.comm.topology import Groups
from zerompi.errors import UsageError, ZeroMPIError
from zerompi.shard.bucket import Bucket, Storage
from zerompi.shard.collectives import BucketCollectives, BucketState
from zerompi.shard.wiring import CommFactory
from zerompi.comm.codec import BlockCodec
from zerompi.shard.compression import Compression
from zerompi.shard.layout import ParamSpec, plan_buckets
from zerompi.shard.placement import place
from zerompi.shard.stages import plan_for

STAGES = [0, 1, 2, 3]
DTYPES = [torch.float32, torch.bfloat16]
NUMEL = 3 * 4 + 4 + 4 * 2 + 2


class Recording(MPIGroup):
    """COMM_SELF, logging (verb, kind, async_op) of every tensor collective."""

    def __init__(self):
        super().__init__(MPI.COMM_SELF)
        self.log: list[tuple[str, str, bool]] = []

    def all_gather(self, shard, out, *, kind="all_gather", async_op=False, what="", used=None):
        self.log.append(("all_gather" + (" in place" if shard is None else ""), kind, async_op))
        return super().all_gather(shard, out, kind=kind, async_op=async_op, what=what, used=used)

    def reduce_scatter(self, full, *, kind="reduce_scatter", async_op=False, what="", used=None):
        self.log.append(("reduce_scatter", kind, async_op))
        return super().reduce_scatter(full, kind=kind, async_op=async_op, what=what, used=used)

    def all_reduce(self, t, *, kind="all_reduce", async_op=False, what=""):
        self.log.append(("all_reduce", kind, async_op))
        return super().all_reduce(t, kind=kind, async_op=async_op, what=what)

    def take(self) -> list[tuple[str, str, bool]]:
        log, self.log = self.log, []
        return log


def build(stage: int, dtype: torch.dtype, compression: Compression = Compression()):
    """A one-bucket model as ShardedModel._build makes it (reverse registration order)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    named = list(model.named_parameters())
    original = {n: p.detach().clone() for n, p in named}
    (layout,) = plan_buckets([ParamSpec(n, tuple(p.shape), 0) for n, p in reversed(named)], 1, 10**9)
    params = [model.get_parameter(s.fqn) for s in layout.slots]
    init = torch.zeros(layout.padded_numel)
    for p, s in zip(params, layout.slots):
        init[s.offset:s.offset + s.numel].copy_(p.detach().reshape(-1))
    group = Recording()
    where = Storage(plan_for(stage), group.rank, group.size, dtype, torch.device("cpu"), check_finite=True)
    kind = place([(s.fqn, s.shape, True) for s in layout.slots], plan_for(stage), 0,
                 {s.fqn: 0 for s in layout.slots}, compression=compression)[0]  # the bucket's parameters' record
    bucket = Bucket(layout, params, where, init, kind)
    comm = CommFactory(Groups(group, group, group), error_feedback=compression.error_feedback).build(
        layout, where.plan, kind, where.rank, where.device, bucket.param_full.tensor)
    return model, original, BucketCollectives(bucket, comm), group, init


def grads(bucket: BucketCollectives, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.shape, generator=g).to(dtype) for s in bucket.bucket.layout.slots]


def flat(gs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1).float() for g in gs])


def backward(bucket: BucketCollectives, gs: list[torch.Tensor]) -> list[bool]:
    bucket.begin_backward()
    return [bucket.add_grad(i, g) for i, g in enumerate(gs)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_construction(stage, dtype):
    model, original, b, group, init = build(stage, dtype)
    assert [s.fqn for s in b.bucket.layout.slots] == ["2.bias", "2.weight", "0.bias", "0.weight"]
    assert b.name == "bucket 0 [2.bias ...]" + (" of module '<root>'" if stage == 3 else "")
    assert b.state is (BucketState.SHARDED if stage == 3 else BucketState.GATHERED)
    assert b.bucket.param_full.is_allocated is (stage < 3)
    assert b.bucket.grad_full.is_allocated is (stage <= 1)
    assert b.bucket.separate is (dtype != torch.float32)
    assert (b.bucket.master is b.bucket.param_tier.tensor) is (dtype == torch.float32)  # fp32: the master is the parameter
    assert b.bucket.master.dtype == torch.float32 and torch.equal(b.bucket.master, init)
    assert b.bucket.own.start == 0 and b.bucket.own.stop == NUMEL
    assert b.state_bytes() == 2 * NUMEL * 4  # params + grads (c), + an fp32 master when c is bf16
    assert group.take() == [] and group.monitor.agreement.seq == 0  # no collective: ShardedModel broadcasts init
    if stage < 3:
        for n, p in model.named_parameters():
            assert p.dtype == dtype and torch.equal(p.detach(), original[n].to(dtype))
    assert torch.equal(b.full_master(), init)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_unshard_reshard(stage, dtype):
    model, original, b, group, _ = build(stage, dtype)
    assert b.unshard().wait() is None
    assert b.state is BucketState.GATHERED and b.bucket.param_full.is_allocated
    assert group.take() == ([("all_gather", "all_gather", False)] if stage == 3 else [])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), original[n].to(dtype))
    # a second unshard of a gathered bucket has nothing to start (a finished Work, no collective)
    assert b.unshard(async_op=True).wait() is None and group.take() == []
    b.reshard()
    # below stage 3 the parameters are never sharded: reshard keeps them gathered
    assert b.state is (BucketState.SHARDED if stage == 3 else BucketState.GATHERED)
    assert b.bucket.param_full.is_allocated is (stage < 3)
    b.reshard()  # twice: no-op
    assert b.state is (BucketState.SHARDED if stage == 3 else BucketState.GATHERED)
    assert group.take() == []
    if stage == 3:  # between gathers: the shape over one NaN element, never the freed storage
        for n, p in model.named_parameters():
            assert p.shape == original[n].shape and p.untyped_storage().nbytes() == p.element_size()
            assert p.detach().isnan().all() and b.bucket.holds(p.data)
            with pytest.raises(RuntimeError, match="single memory location"):
                p.detach().add_(1)
        b.unshard()
        for n, p in model.named_parameters():  # bound to the buffer again
            assert torch.equal(p.detach(), original[n].to(dtype)) and b.bucket.holds(p.data)


def test_a_copy_put_in_place_of_a_parameter_is_left_bound():
    """GatheredParameters puts a whole copy in place of a parameter for its block: a gather or release
    inside the block must not bind it back to the buffer (the block's changes would be lost)."""
    model, original, b, group, _ = build(3, torch.float32)
    p = model[0].weight
    copy = torch.full(p.shape, 7.0)
    p.data = copy
    assert not b.bucket.holds(p.data)
    b.unshard()
    b.reshard()
    assert p.data.data_ptr() == copy.data_ptr() and torch.equal(p.detach(), torch.full(p.shape, 7.0))
    others = [q for q in model.parameters() if q is not p]
    assert all(b.bucket.holds(q.data) and q.detach().isnan().all() for q in others)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefetch_then_wait_stage3(dtype):
    model, original, b, group, _ = build(3, dtype)
    with pytest.raises(ZeroMPIError, match="wait_gathered.. in state SHARDED"):
        b.wait_gathered()  # no gather was started
    b.prefetch()
    # in flight until waited for: GATHERING, and unshard() hands back the same gather
    assert b.state is BucketState.GATHERING and group.take() == [("all_gather", "all_gather", True)]
    b.unshard()
    assert b.state is BucketState.GATHERING and group.take() == []
    b.progress()
    b.wait_gathered()
    assert b.state is BucketState.GATHERED
    b.wait_gathered()  # nothing in flight: no-op
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), original[n].to(dtype))
    b.reshard()
    b.prefetch()
    with pytest.raises(ZeroMPIError, match="publish.. in state GATHERING"):
        b.publish()  # a step runs on sharded parameters
    b.reshard()  # releasing with a gather in flight waits for it first
    assert b.state is BucketState.SHARDED and not b.bucket.param_full.is_allocated
    assert group.take() == [("all_gather", "all_gather", True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_reduce_on_one_rank_leaves_the_gradient_unchanged(stage, dtype):
    _, _, b, group, _ = build(stage, dtype)
    gs = grads(b, 1, dtype)
    assert b.needs_reduce() is True  # never reduced yet
    assert backward(b, gs) == [False, False, False, True]  # True once every slot has reported
    assert b.needs_reduce()
    b.reduce_grads()
    assert not b.needs_reduce()
    expected = {0: [("reduce_scatter", "all_reduce", False), ("all_gather in place", "all_reduce", False)]}
    assert group.take() == expected.get(stage, [("reduce_scatter", "reduce_scatter", False)])
    g = b.bucket.master_grad()
    assert g.dtype == torch.float32 and torch.equal(g, flat(gs))
    assert b.bucket.grad_full.is_allocated is (stage <= 1)  # stages 2-3 release the full gradient bucket
    assert b.state is (BucketState.SHARDED if stage == 3 else BucketState.GATHERED)  # grads need no gather


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlapped_reduce_applies_at_finish(stage):
    _, _, b, group, _ = build(stage, torch.float32)
    gs = grads(b, 2, torch.float32)
    backward(b, gs)
    b.reduce_grads(async_op=True)
    assert group.take() == [("reduce_scatter", "reduce_scatter", True)]
    # no reduction has landed yet: the reduced gradient is zeros until finish
    assert torch.equal(b.bucket.master_grad(), torch.zeros(NUMEL))
    b.progress()
    b.finish_reduce()
    b.finish_reduce()  # nothing in flight: no-op
    assert torch.equal(b.bucket.master_grad(), flat(gs))


def test_stage0_ignores_async_op():
    _, _, b, group, _ = build(0, torch.float32)
    backward(b, grads(b, 3, torch.float32))
    b.reduce_grads(async_op=True)
    assert [entry[2] for entry in group.take()] == [False, False]


@pytest.mark.parametrize("stage", STAGES)
def test_accumulation_over_two_backwards(stage):
    _, _, b, _, _ = build(stage, torch.float32)
    g1, g2 = grads(b, 4, torch.float32), grads(b, 5, torch.float32)
    backward(b, g1)
    if stage >= 2:  # as ShardedModel: stages 0-1 reduce only in the last backward of the window
        b.reduce_grads()
    backward(b, g2)
    b.reduce_grads()
    assert torch.equal(b.bucket.master_grad(), flat(g1) + flat(g2))


@pytest.mark.parametrize("stage", STAGES)
def test_late_gradient_after_reduce(stage):
    _, _, b, _, _ = build(stage, torch.float32)
    gs = grads(b, 6, torch.float32)
    backward(b, gs)
    b.reduce_grads()
    late = torch.ones(b.bucket.layout.slots[0].shape)
    if stage <= 1:
        with pytest.raises(UsageError, match="'2.bias' received a second gradient after its bucket was reduced"):
            b.add_grad(0, late)
        return
    # stages 2-3 accept it; every slot still counts as reported in this backward, so add_grad says
    # "complete" and ShardedModel reduces the bucket again at once
    assert b.add_grad(0, late) is True and b.needs_reduce()
    b.reduce_grads()
    assert torch.equal(b.bucket.master_grad(), flat(gs) + flat([late] + [torch.zeros(s.shape) for s in b.bucket.layout.slots[1:]]))


@pytest.mark.parametrize("stage", [2, 3])
def test_late_gradient_finishes_an_overlapped_reduce_first(stage):
    _, _, b, _, _ = build(stage, torch.float32)
    gs = grads(b, 7, torch.float32)
    backward(b, gs)
    b.reduce_grads(async_op=True)
    b.add_grad(1, gs[1])
    assert torch.equal(b.bucket.master_grad(), flat(gs))  # applied by add_grad, before the late gradient


@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad(stage):
    _, _, b, _, _ = build(stage, torch.float32)
    gs = grads(b, 8, torch.float32)
    backward(b, gs)
    b.reduce_grads()
    b.bucket.zero_grad()
    # after zero_grad no reduced gradient is left, at any stage (stages 0-1 zero the unwritten slots
    # of the full buffer at the next reduction)
    assert torch.equal(b.bucket.master_grad(), torch.zeros(NUMEL))
    b.begin_backward()
    b.reduce_grads()  # a backward in which no gradient reached the bucket reduces zeros
    assert torch.equal(b.bucket.master_grad(), torch.zeros(NUMEL))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_keeps_an_unreduced_late_gradient(stage):
    _, _, b, _, _ = build(stage, torch.float32)
    backward(b, grads(b, 9, torch.float32))
    b.reduce_grads()
    b.add_grad(0, torch.ones(2))
    b.bucket.zero_grad()
    b.reduce_grads()
    # at stages 2-3 zero_grad clears the shard but not a gradient still waiting in the full buffer,
    # which the next reduction adds (stages 0-1 would drop it). ShardedModel always reduces before a
    # step, so the engine never reaches this.
    assert b.bucket.master_grad()[:2].tolist() == [1.0, 1.0] and not b.bucket.master_grad()[2:].any()


@pytest.mark.parametrize("stage", STAGES)
def test_second_reduce_in_one_backward_is_idempotent_on_one_rank(stage):
    _, _, b, group, _ = build(stage, torch.float32)
    gs = grads(b, 10, torch.float32)
    backward(b, gs)
    b.reduce_grads()
    # nothing pending, yet reduce_grads communicates again (stages 0-1 reduce the same
    # full buffer; stages 2-3 re-allocate it and reduce zeros); the result is unchanged here
    b.reduce_grads()
    assert torch.equal(b.bucket.master_grad(), flat(gs))
    assert len(group.take()) == (4 if stage == 0 else 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_publish_brings_the_master_into_the_parameters(stage, dtype):
    model, original, b, group, init = build(stage, dtype)
    with torch.no_grad():
        b.bucket.master.add_(0.3)
    if stage < 3 and dtype == torch.float32:  # the master is the parameter storage: visible at once
        assert torch.equal(model[0].bias.detach(), original["0.bias"] + 0.3)
    b.publish()
    assert group.take() == ([("all_gather in place", "all_gather", False)] if stage in (1, 2) else [])
    b.unshard()
    for p, s in zip(b.bucket.params, b.bucket.layout.slots):
        assert torch.equal(p.detach(), (init + 0.3)[s.offset:s.offset + s.numel].view(s.shape).to(dtype))
    assert torch.equal(b.full_master(), init + 0.3)


def test_nonfinite_gradients_are_named():
    _, _, b, _, _ = build(2, torch.bfloat16)
    gs = grads(b, 11, torch.bfloat16)
    gs[2][1] = float("nan")
    backward(b, gs)
    assert b.bucket.nonfinite == ["0.bias"]


@pytest.mark.parametrize("stage", [1, 3])
def test_state_bytes_count_the_packed_codes_of_a_trainable_bucket(stage):
    """Quantized weights (int8) and gradients with error feedback: what the collectives hold persistently,
    the packed shard (n (1 + 4/block) bytes, the codec's arithmetic) and the fp32 residual of the whole
    bucket, is counted beside the bucket's own storage."""
    codec = BlockCodec(8, 4)
    _, _, b, _, _ = build(stage, torch.float32, Compression(codec, BlockCodec(8, 4), error_feedback=True))
    shard = b.bucket.layout.shard_numel
    assert b.weight_codes is not None and b.grad_codes is not None and b.grad_codes.residual is not None
    packed = codec.nbytes(shard)
    residual = b.bucket.layout.padded_numel * 4
    assert b.state_bytes() == b.bucket.state_bytes() + packed + residual


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_with_quantized_weights_compute_with_decoded_values_from_the_start(stage):
    """The compute parameters are what the quantized gather after each step gives: from the build on, not from the
    first step (else step 0's forward alone uses exact values). Reference: int8 per block of 4, s = max|x| / 127,
    x -> round(x / s) s, written out here."""
    _, _, b, _, init = build(stage, torch.float32, Compression(BlockCodec(8, 4)))
    n = init.numel()  # one rank: one chunk, its last block padded with zeros
    blocks = torch.cat([init, init.new_zeros(-n % 4)]).view(-1, 4)
    s = blocks.abs().amax(dim=1, keepdim=True) / 127
    expected = ((blocks / s).round().clamp(-127, 127) * s).reshape(-1)[:n]
    got = b.bucket.param_full.tensor
    assert not torch.equal(got, init)  # the codes round: exact values would be the mutant's
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
