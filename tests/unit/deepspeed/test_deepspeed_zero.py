"""deepspeed.zero on a world of one: Init builds on the meta device for initialize to materialise,
GatheredParameters gives whole parameters and writes one rank's changes back into the engine."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import zerompi.deepspeed as deepspeed
from zerompi.errors import UsageError

LOCAL = {"device": "cpu", "cpu_threads": 1, "abort_on_exception": False, "param_persistence_threshold": 0}


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def test_init_keeps_parameters_on_meta_and_buffers_real():
    with deepspeed.zero.Init(config_dict_or_path=config(3), remote_device="cpu", pin_memory=True, dtype=torch.half):
        m = build()
    assert all(p.is_meta for p in m.parameters()) and not any(b.is_meta for b in m.buffers())
    assert nn.Module.register_parameter is not None and not nn.Linear(1, 1).weight.is_meta  # patch undone
    with deepspeed.zero.Init(enabled=False):
        assert not nn.Linear(1, 1).weight.is_meta
    with pytest.raises(UsageError, match="data parallel only"):
        deepspeed.zero.Init(mpu=object())


@pytest.mark.parametrize("stage", (2, 3))
def test_initialize_materialises_what_init_built(stage):
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        m = build()
    engine, *_ = deepspeed.initialize(model=m, config=config(stage), comm=MPI.COMM_SELF, overrides=LOCAL)
    full = engine.engine.full_state_dict()
    assert not any(v.is_meta for v in full.values()) and full["0.weight"].abs().sum() > 0
    x = torch.randn(2, 4)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.close()


def test_gathered_parameters_before_initialize_makes_them_real():
    with deepspeed.zero.Init():
        m = build()
    with deepspeed.zero.GatheredParameters(m[0].weight, modifier_rank=0):
        assert not m[0].weight.is_meta and m[0].weight.shape == (8, 4)
        with torch.no_grad():
            m[0].weight.fill_(0.5)
    assert torch.equal(m[0].weight, torch.full((8, 4), 0.5)) and not m[0].bias.is_meta  # its module's too
    assert m[2].weight.is_meta  # others wait for initialize
    engine, *_ = deepspeed.initialize(model=m, config=config(3), comm=MPI.COMM_SELF, overrides=LOCAL)
    assert torch.equal(engine.engine.full_state_dict()["0.weight"], torch.full((8, 4), 0.5))
    engine.close()


def test_gathered_parameters_leave_torchs_generator_where_it_was():
    """Making parameters real draws their values (reset_parameters) from the global generator; the draws
    the user makes next are a plain run's (ZeRO-3 from_pretrained, then get_peft_model: LoRA's matrices).
    Break: drop _generators_kept and the next draw differs."""
    torch.manual_seed(0)
    plain = torch.rand(3)
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        m = build()
    with deepspeed.zero.GatheredParameters(list(m.parameters()), modifier_rank=0):
        assert not any(p.is_meta for p in m.parameters()) and m[0].weight.abs().sum() > 0  # drawn, not zeros
    assert torch.equal(torch.rand(3), plain)


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_gathered_parameters_in_an_engine(stage):
    torch.manual_seed(0)
    m = build()
    engine, *_ = deepspeed.initialize(model=m, config=config(stage), comm=MPI.COMM_SELF, overrides=LOCAL)
    before = engine.engine.full_state_dict()
    with deepspeed.zero.GatheredParameters(list(m[2].parameters())):
        assert torch.equal(m[2].weight.float(), before["2.weight"])
        with torch.no_grad():
            m[2].weight.add_(1.0)  # without modifier_rank: not kept
    assert torch.equal(engine.engine.full_state_dict()["2.weight"], before["2.weight"])
    with deepspeed.zero.GatheredParameters(m[2].weight, modifier_rank=0):
        with torch.no_grad():
            m[2].weight.mul_(2.0)
    after = engine.engine.full_state_dict()
    assert torch.equal(after["2.weight"], before["2.weight"] * 2) and torch.equal(after["0.weight"], before["0.weight"])
    engine.eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        reference = build()
        reference.load_state_dict({**m.state_dict(), **after}, strict=False)
        reference.eval()
        assert torch.allclose(engine(x), reference(x), atol=1e-6)  # the forward computes with it
    engine.train()
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.close()
