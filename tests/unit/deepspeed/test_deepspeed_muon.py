"""``"optimizer": {"type": "Muon"}``: the translation into two halves, DeepSpeed's tags and defaults, the
refusals, and the Gram iteration's algebra (tests/mpi/test_ds_muon.py compares training with DeepSpeed)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerompi.compat.deepspeed import muon as ds_muon
from zerompi.compat.deepspeed.config import config_from, translate
from zerompi.compat.deepspeed.ops import muon as ops
from zerompi.errors import ConfigError, UsageError


def doc(**params):
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": params}}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 10)


def test_halves_take_deepspeeds_defaults_and_overrides():
    t = translate(doc(lr=0.01, muon_lr=0.03, momentum=0.9))
    assert t.muon.muon == {"lr": 0.03, "momentum": 0.9, "weight_decay": 0.0, "ns_method": "gram"}
    assert t.muon.adam == {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
    assert t.kwargs["optimizer"] == "adamw" and t.kwargs["lr"] == 0.01 and t.kwargs["eps"] == 1e-10
    bare = translate(doc())
    assert bare.muon.muon["lr"] == 0.02 and bare.muon.adam["lr"] == 3e-4
    assert translate(doc(adam_w_mode=False, adam_lr=0.002)).kwargs["optimizer"] == "adam"


@pytest.mark.parametrize("params, key", [({"bias_correction": False}, "optimizer.params.bias_correction"),
                                         ({"per_head_muon": True}, "per_head_muon"),
                                         ({"ns_method": "svd"}, "ns_method")])
def test_what_cannot_be_honoured_is_refused_by_name(params, key):
    with pytest.raises(ConfigError, match=key):
        translate(doc(**params))


def test_a_config_alone_cannot_split_the_model():
    with pytest.raises(ConfigError, match="zerompi.deepspeed.initialize"):
        config_from(doc())


def test_clipping_past_stage_0_and_16_bit_are_refused():
    ds_muon.check(0, 1.0, torch.float32)  # DeepSpeed clips gradients at stage 0, as zerompi does
    ds_muon.check(2, None, torch.float32)
    with pytest.raises(UsageError, match="gradient_clipping=1"):
        ds_muon.check(1, 1.0, torch.float32)
    with pytest.raises(UsageError, match="bf16.enabled"):
        ds_muon.check(0, None, torch.bfloat16)


def test_groups_follow_deepspeeds_tags_not_the_scripts():
    net = Net()
    net.body.weight.use_muon = False  # DeepSpeed's initialize overwrites it
    net.body.bias.requires_grad_(False)
    settings = translate(doc(muon_lr=0.05, adam_lr=0.001)).muon
    groups = ds_muon.param_groups(net, [{"params": list(net.parameters()), "weight_decay": 0.1, "name": "all"}],
                                  settings)
    muon, adam = groups
    assert muon["params"] == [net.body.weight] and muon["optimizer"] is ops.Muon
    assert muon["lr"] == 0.05 and muon["weight_decay"] == 0.1 and muon["momentum"] == 0.95
    assert {id(p) for p in adam["params"]} == {id(net.embed_tokens.weight), id(net.lm_head.weight),
                                              id(net.lm_head.bias)}
    assert adam == {"params": adam["params"], "weight_decay": 0.1}  # the rest is the config's optimizer's
    with pytest.raises(UsageError, match="'amsgrad'"):
        ds_muon.param_groups(net, [{"params": list(net.parameters()), "amsgrad": True}], settings)
    stray = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(UsageError, match="1 of model_parameters"):
        ds_muon.param_groups(net, [{"params": [stray]}], settings)


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (7, 7), (3, 4, 9)])
def test_the_gram_iteration_is_the_plain_one(shape):
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gram, plain = ops._gram(g, 5, torch.float64), ops._standard(g, 5, torch.float64)
    assert torch.allclose(gram, plain, rtol=0, atol=1e-10)
    s = torch.linalg.svdvals(plain)  # quintic NS leaves singular values near 1, not at it
    assert s.min() > 0.5 and s.max() < 1.3


def test_muon_steps_like_deepspeeds_formula():
    p = nn.Parameter(torch.randn(6, 3))
    start, g = p.detach().clone(), torch.randn(6, 3)
    opt = ops.Muon([p], lr=0.1, momentum=0.5, weight_decay=0.2, ns_method="gram")
    p.grad = g.clone()
    opt.step()
    # m = g/2 after one step; Newton-Schulz runs in fp16 where the CPU has it (mkldnn), and the direction is
    # scaled there and cast to the gradient's dtype before the step multiplies it by lr
    u = (ops.orthogonalise(g.lerp(0.5 * g, 0.5), "gram") * (6 / 3) ** 0.5).to(g.dtype)
    assert torch.allclose(p.detach(), start * (1 - 0.02) - 0.1 * u, atol=1e-6)
    assert torch.equal(p.grad, g)  # the gradient is left as it was
    with pytest.raises(ValueError, match="shape"):
        ops.Muon([nn.Parameter(torch.zeros(3))])
