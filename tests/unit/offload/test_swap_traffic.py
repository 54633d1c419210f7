"""engine.stats counts the NVMe swap traffic of a step exactly: stage 3 with parameters, gradients, master and
Adam state in the swap file moves, per bucket of S elements per rank (one micro-batch; the parameter shard
and the gradient shard in the compute dtype, master and moments in fp32):

    reads:  parameter shard twice (forward, backward), gradient once, master and both moments once
    writes: gradient once (the reduction), master and both moments once, parameter shard once (publish;
            in fp32 the parameter shard is the master's region, offload/tiers.py MasterAlias: not written)

each transfer rounded up to the swap file's 4 KiB pages (what benchmarks/bench_offload.py divides by the
raw bandwidth to get the step's traffic limit). The read-ahead of the first units for the next forward
happens at the end of a backward, so a step's reads are the same from the third step on. With
optimizer_in_backward the gradient shard is neither written nor read: it goes from the reduction
straight into the update."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import zerompi
from zerompi.blockio.aligned import round_up


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in_backward"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_step_traffic_matches_the_model(tmp_path, dtype, in_backward):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    cfg = zerompi.ZeroConfig(stage=3, bucket_mb=0.01, cpu_threads=1, device="cpu", abort_on_exception=False, dtype=dtype,
                             offload_optimizer="nvme", offload_params="nvme", nvme_path=str(tmp_path),
                             optimizer_in_backward=in_backward)
    engine = zerompi.initialize(model, cfg, comm=MPI.COMM_SELF)
    g = torch.Generator().manual_seed(1)

    def step():
        engine.backward(engine(torch.randn(8, 64, generator=g)).pow(2).mean())
        engine.step()
    step()  # creates the Adam moments and records the order of the units for the read-ahead
    step()  # its backward reads the first unit ahead for the next forward: from here on every step alike
    before = engine.stats
    read0, written0 = before.swap_read_bytes, before.swap_write_bytes
    ahead = [b.grads.tier.read_ahead for b in engine.sharded.buckets]
    step()
    after = engine.stats
    # the step reads each gradient but the first while it updates the bucket before: bytes unchanged
    assert [b.grads.tier.read_ahead - a for b, a in zip(engine.sharded.buckets, ahead)] == \
        [0] * len(ahead) if in_backward else [0] + [1] * (len(ahead) - 1)
    fp32 = sum(round_up(b.own.numel * 4) for b in engine.sharded.buckets)  # one fp32 tensor per bucket
    compute = fp32 if dtype == "fp32" else sum(round_up(b.own.numel * 2) for b in engine.sharded.buckets)
    grad = 0 if in_backward else compute
    assert after.swap_read_bytes - read0 == 2 * compute + grad + 3 * fp32
    assert after.swap_write_bytes - written0 == grad + 3 * fp32 + (0 if dtype == "fp32" else compute)
    assert after.swap_io_seconds > 0
    engine.close()
