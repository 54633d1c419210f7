"""Which optimizers step flat shards and which whole tensors (zerompi/optim/kinds.py); what the engine
cannot run is refused by name; a param-group key the optimizer does not take is refused, never ignored."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig
from zerompi.errors import ConfigError, UsageError
from zerompi.optim.kinds import ELEMENTWISE, GROUP_KEYS, group_keys, is_elementwise


class DeclaredSGD(torch.optim.SGD):
    elementwise = True


class Undeclared(torch.optim.SGD):
    """A subclass may change the arithmetic: not presumed element-wise."""


@pytest.mark.parametrize("value,why", [(torch.optim.LBFGS, "closure"), ("torch.optim.SparseAdam", "sparse"),
                                       (type("MyLBFGS", (torch.optim.LBFGS,), {}), "closure")])
def test_what_the_engine_cannot_run_is_refused_at_initialize_naming_the_key(value, why):
    def rank(group):
        with pytest.raises(ConfigError, match=rf"optimizer=.*cannot run here: .*{why}"):
            zerompi.initialize(_model(), ZeroConfig(stage=2, device="cpu", optimizer=value), group=group)
    run_ranks(2, rank)


@pytest.mark.parametrize("cls", [*ELEMENTWISE, DeclaredSGD])
def test_elementwise_optimizers_step_flat_shards(cls):
    assert is_elementwise(cls)


@pytest.mark.parametrize("cls", [torch.optim.Adafactor, torch.optim.Muon, Undeclared])
def test_others_step_whole_tensors(cls):
    assert not is_elementwise(cls)


def test_a_declaration_is_the_class_own():
    """A subclass of a declared class changes the arithmetic as freely: it declares it again."""
    assert not is_elementwise(type("Sub", (DeclaredSGD,), {}))


@pytest.mark.parametrize("cls", [*ELEMENTWISE, torch.optim.Adafactor, torch.optim.Muon, DeclaredSGD])
def test_the_group_keys_are_those_torch_keeps_in_a_group(cls):
    """group_keys(cls) is the options of cls and its optimizer bases, not torch.optim.Optimizer's own
    (``defaults`` is no group key): checked against the keys torch puts in a built optimizer's param group."""
    built = cls([nn.Parameter(torch.zeros(2, 2))])
    assert group_keys(cls) == set(built.param_groups[0]) - {"params"} | set(GROUP_KEYS)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_a_param_group_key_the_optimizer_does_not_take_is_refused():
    def rank(group):
        model = _model()
        groups = [{"params": list(model[0].parameters()), "lr": 0.1, "weight_decy": 0.0},
                  {"params": list(model[1].parameters())}]
        with pytest.raises(UsageError, match=r"param_groups\[0\] sets 'weight_decy', which AdamW does not take"):
            zerompi.initialize(model, ZeroConfig(stage=2, device="cpu"), group=group, param_groups=groups)
    run_ranks(2, rank)


def test_a_tensor_a_whole_tensor_optimizer_refuses_is_named():
    """Muon takes 2-D tensors only: a bias in its group is named, before anything is built."""
    def rank(group):
        model = _model()
        groups = [{"params": list(model[0].parameters()), "optimizer": torch.optim.Muon},
                  {"params": list(model[1].parameters())}]
        with pytest.raises(ConfigError, match=r"param_groups\[0\]\['optimizer'\]: Muon refuses parameter '0.bias' "
                                              r"of shape \[4\]"):
            zerompi.initialize(model, ZeroConfig(stage=2, device="cpu"), group=group, param_groups=groups)
    run_ranks(2, rank)


def test_known_group_keys_still_train():
    def rank(group):
        model = _model()
        groups = [{"params": list(model[0].parameters()), "weight_decay": 0.0, "initial_lr": 1e-3},
                  {"params": list(model[1].parameters())}]
        engine = zerompi.initialize(model, ZeroConfig(stage=2, device="cpu"), group=group, param_groups=groups)
        engine.backward(engine(torch.ones(3, 4)).sum())
        assert engine.step()
        engine.close()
    run_ranks(2, rank)


def test_a_base_class_option_in_the_defaults_is_a_known_key():
    """torch's AdamW keeps Adam's decoupled_weight_decay in its defaults (accelerate hands such groups on)."""
    from zerompi.optim.kinds import check_group_options
    check_group_options(torch.optim.AdamW, [{"decoupled_weight_decay": True, "lr": 0.1}])
