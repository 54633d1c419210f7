"""Offload tiers and the gradient shard: the same arithmetic whether a shard stays in memory or
lives in a real swap file (O_DIRECT where the filesystem allows it)."""
from __future__ import annotations

import pytest
import torch

from zerompi.config import Offload
from zerompi.offload import NVMeSwapper, Resident, Swapped, TierPlan
from zerompi.shard.grads import GradShard


def _reductions(n: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_shard_is_tier_independent(tmp_path, dtype):
    n = 3000
    with NVMeSwapper(tmp_path, 0) as swapper:
        tiers = [Resident(torch.zeros(n, dtype=dtype)), Swapped(swapper, "g", torch.zeros(n, dtype=dtype))]
        shards = [GradShard(t, n, torch.device("cpu")) for t in tiers]
        for reduced in _reductions(n, 3):
            for s in shards:
                s.write(reduced.to(dtype).float(), accumulate=True)
        norms = [s.norm_sq(1.0) for s in shards]
        assert norms[0] == norms[1]
        taken = [s.take(1.0, 0.5) for s in shards]
        assert torch.equal(taken[0], taken[1])
        assert tiers[1].nbytes == 0  # between uses the swapped shard holds no memory
        for s in shards:
            s.zero()
            assert s.norm_sq(1.0) == 0.0 and not s.peek().any()


def test_power_of_two_loss_scale_gives_the_same_norm_on_both_tiers(tmp_path):
    n, scale = 1000, 2.0 ** 12
    with NVMeSwapper(tmp_path, 0) as swapper:
        shards = [GradShard(Resident(torch.zeros(n)), n, torch.device("cpu")),
                  GradShard(Swapped(swapper, "g", torch.zeros(n)), n, torch.device("cpu"))]
        for s in shards:
            s.write(_reductions(n, 1)[0] * scale, accumulate=True)
        assert shards[0].norm_sq(scale) == shards[1].norm_sq(scale)
        assert torch.equal(shards[0].take(scale, 1.0), shards[1].take(scale, 1.0))


def test_swapped_shard_round_trips_and_prefetches(tmp_path):
    with NVMeSwapper(tmp_path, 0) as swapper:
        values = torch.arange(5000, dtype=torch.float32)
        tier = Swapped(swapper, "p", values.clone())
        assert not tier.stays_resident and tier.nbytes == 0
        tier.prefetch()
        assert tier.read_ahead == 1
        with tier.loaded() as shard:
            assert torch.equal(shard, values)
            shard.add_(1)
            tier.store()
        with tier.loaded() as shard:
            assert torch.equal(shard, values + 1)


def test_tier_plan_places_shards_as_the_settings_say(tmp_path):
    cpu = torch.device("cpu")
    assert not TierPlan(Offload.CPU, Offload.CPU, cpu).moves_state  # host memory already
    assert TierPlan(Offload.NVME, Offload.NONE, cpu).moves_state
    plan = TierPlan(Offload.NONE, Offload.CPU, cpu)
    shard = torch.ones(4)
    tier = plan.param_tier(0, shard, Offload.CPU)
    assert isinstance(tier, Resident) and tier.tensor is not shard and torch.equal(tier.tensor, shard)
    with NVMeSwapper(tmp_path, 0) as swapper:
        nvme = TierPlan(Offload.NVME, Offload.NVME, cpu, shard_grads=True, swapper=swapper)
        assert isinstance(nvme.param_tier(0, torch.ones(8), Offload.NVME), Swapped)
        assert isinstance(nvme.grad_tier(0, torch.zeros(8)), Swapped)
        assert isinstance(TierPlan(Offload.NVME, shard_grads=False, swapper=swapper).grad_tier(1, torch.zeros(8)),
                          Resident)  # stage 1: gradients are not sharded, they stay with the buffer
        master = nvme.place_master(0, torch.ones(8), separate=True)
        assert master.numel() == 0 and swapper.region("b0.master").nbytes == 32
