"""Optimizers that look at whole tensors are refused by name, never trained wrong on flat shards
(zerompi/optim/kinds.py); a param-group key the optimizer does not take is refused, never ignored."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerompi
from zerompi.comm.local import run_ranks
from zerompi.config import ZeroConfig
from zerompi.errors import ConfigError, UsageError
from zerompi.optim.kinds import ELEMENTWISE, check_elementwise, is_elementwise


class DeclaredSGD(torch.optim.SGD):
    elementwise = True


class Undeclared(torch.optim.SGD):
    """A subclass may change the arithmetic: not presumed element-wise."""


@pytest.mark.parametrize("value", [torch.optim.Adafactor, "torch.optim.Adafactor", torch.optim.Muon,
                                   torch.optim.LBFGS, torch.optim.SparseAdam, Undeclared])
def test_whole_tensor_optimizers_are_refused_at_initialize_naming_the_key(value):
    """Before: Adafactor trained 3.3e-3 away from per-tensor Adafactor after one step, silently."""
    def rank(group):
        with pytest.raises(ConfigError, match=r"optimizer=.*is not known to update element-wise.*allowed: "
                                              r"torch\.optim's Adam, AdamW, SGD"):
            zerompi.initialize(_model(), ZeroConfig(stage=2, device="cpu", optimizer=value), group=group)
    run_ranks(2, rank)


@pytest.mark.parametrize("cls", [*ELEMENTWISE, DeclaredSGD])
def test_elementwise_optimizers_are_accepted(cls):
    assert is_elementwise(cls)
    check_elementwise(cls, cls)


def test_a_declaration_is_the_class_own():
    """A subclass of a declared class changes the arithmetic as freely: it declares it again."""
    assert not is_elementwise(type("Sub", (DeclaredSGD,), {}))


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


def test_a_group_that_chooses_a_whole_tensor_optimizer_is_refused_naming_it():
    """Before the groups could choose (optim/groups.py), its "optimizer" key was refused as unknown."""
    def rank(group):
        model = _model()
        groups = [{"params": list(model[0].parameters()), "optimizer": torch.optim.Muon},
                  {"params": list(model[1].parameters())}]
        with pytest.raises(ConfigError, match=r"param_groups\[0\]\['optimizer'\]=.*Muon.*not known to update"):
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
