"""``p.ds_status`` (compat/deepspeed/param_status.py) on the parameters stage 3 does not shard and on those it
does not re-class: a persistent parameter (below ``param_persistence_threshold``) is AVAILABLE whenever it is
read, its full values in place, as DeepSpeed keeps ``ds_persist`` parameters; a parameter of another
``nn.Parameter`` subclass keeps its class and has no ``ds_status``."""
from __future__ import annotations

import torch
from mpi4py import MPI
from torch import nn

import zerompi.deepspeed as deepspeed
from zerompi.compat.deepspeed.param_status import StatusParameter
from zerompi.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from .test_deepspeed_zero import LOCAL, config


class Marked(nn.Parameter):
    """A parameter subclass of the model's own (as a quantised weight would be)."""


def _engine(threshold: int, marked: bool = False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    if marked:
        m[2].weight = Marked(m[2].weight.detach().clone())
    engine, *_ = deepspeed.initialize(model=m, config=config(3), comm=MPI.COMM_SELF,
                                      overrides={**LOCAL, "param_persistence_threshold": threshold})
    return engine, m


def test_a_persistent_parameter_is_available_with_its_values_in_place():
    """2.bias (3 elements) is below the threshold of 8 and stays whole: AVAILABLE while the others are
    sharded, inside and after a step, its values the engine's full state of it; 0.weight is not."""
    engine, m = _engine(8)
    bias, weight = m[2].bias, m[0].weight
    assert isinstance(bias, StatusParameter) and bias.ds_status is ZeroParamStatus.AVAILABLE
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    seen = []
    m[0].register_forward_pre_hook(lambda *_: seen.append((bias.ds_status, weight.ds_status)))
    engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
    engine.step()
    assert seen == [(ZeroParamStatus.AVAILABLE, ZeroParamStatus.AVAILABLE)]
    assert bias.ds_status is ZeroParamStatus.AVAILABLE and weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert torch.equal(bias.detach(), engine.engine.full_state_dict()["2.bias"])
    engine.close()


def test_a_parameter_of_another_subclass_keeps_its_class_and_has_no_status():
    """Only plain nn.Parameters are re-classed: the Marked weight stays Marked, with no ds_status (as before
    stage 3 marked anything), and still trains."""
    engine, m = _engine(0, marked=True)
    before = engine.engine.full_state_dict()["2.weight"]  # sharded: the parameter's own storage is freed
    kinds = {n: (type(p), hasattr(p, "ds_status")) for n, p in m.named_parameters()}  # no repr: sharded storage
    assert kinds == {"0.weight": (StatusParameter, True), "0.bias": (StatusParameter, True),
                     "2.weight": (Marked, False), "2.bias": (StatusParameter, True)}
    engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
    engine.step()
    kind = type(m[2].weight)
    assert kind is Marked
    assert not torch.equal(engine.engine.full_state_dict()["2.weight"], before)
    engine.close()
