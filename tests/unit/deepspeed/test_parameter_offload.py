"""``engine.optimizer.parameter_offload`` (compat/deepspeed/parameter_offload.py) as TRL's generation uses it:
``remove_hooks`` inside ``GatheredParameters`` pauses the engine's forward hooks, so generation's forwards (as
many as each rank's own sequences need) gather nothing; ``add_hooks`` resumes them. TRL's own functions run."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import zerompi.deepspeed as deepspeed
from tests.components import require_module
from zerompi.shard.collectives import BucketState

from .test_deepspeed_zero import LOCAL, config


def test_trls_remove_hooks_pauses_the_units_and_add_hooks_resumes_them():
    """Break guarded: removing parameter_offload's forward hooks leaves the engine's hooks on (every unit
    would gather in each of generation's forwards)."""
    require_module("trl")
    from trl.models.utils import add_hooks, remove_hooks
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    engine, *_ = deepspeed.initialize(model=m, config=config(3), comm=MPI.COMM_SELF, overrides=LOCAL)
    head = next(c for c in engine.engine.sharded.all_collectives if any(p is m[2].weight for p in c.bucket.params))
    states = []
    m[2].register_forward_pre_hook(lambda *_: states.append(head.state))  # after the engine's (prepended) hook
    full = engine.engine.full_state_dict()
    x = torch.randn(2, 4)
    plain = torch.relu(x @ full["0.weight"].T + full["0.bias"]) @ full["2.weight"].T + full["2.bias"]
    with torch.no_grad(), deepspeed.zero.GatheredParameters(m.parameters()):
        remove_hooks(engine)
        outs = [m(x) for _ in range(3)]  # generation's forwards, on the whole weights in place
        add_hooks(engine)
    assert states == [BucketState.SHARDED] * 3  # the unit was not gathered: its hook was paused
    assert all(torch.allclose(o, plain, atol=1e-6) for o in outs)
    engine.backward(engine(x).pow(2).mean())  # the hooks are back: the unit gathers for training
    engine.step()
    assert states[3:] == [BucketState.GATHERED]
    assert not torch.equal(engine.engine.full_state_dict()["2.weight"], full["2.weight"])
    engine.close()


@pytest.mark.parametrize("stage", (1, 2))
def test_below_stage_3_there_is_no_parameter_offload(stage):
    """As DeepSpeed's ZeRO-1/2 optimizers: TRL takes hooks off only at ZeRO-3."""
    engine, *_ = deepspeed.initialize(model=nn.Linear(4, 2), config=config(stage), comm=MPI.COMM_SELF, overrides=LOCAL)
    assert not hasattr(engine.optimizer, "parameter_offload")
    engine.close()
