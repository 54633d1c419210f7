"""``p.ds_status`` on a stage-3 engine's parameters (compat/deepspeed/param_status.py): on a world of one,
NOT_AVAILABLE while sharded, AVAILABLE while its gather unit computes and inside GatheredParameters, and the
test TRL's fused LM head makes before gathering a weight it reads outside its module's forward; at two
in-process ranks with prefetch, INFLIGHT while a gather started ahead has not been waited for."""
from __future__ import annotations

import pytest
import torch
from mpi4py import MPI
from torch import nn

import zerompi
import zerompi.deepspeed as deepspeed
from zerompi.comm.local import run_ranks
from zerompi.compat.deepspeed import param_status
from zerompi.compat.deepspeed.param_status import StatusParameter
from zerompi.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from .test_deepspeed_zero import LOCAL, config

AVAILABLE, NOT_AVAILABLE, INFLIGHT = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT


def engine_of(stage: int):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    engine, *_ = deepspeed.initialize(model=m, config=config(stage), comm=MPI.COMM_SELF, overrides=LOCAL)
    return engine, m


def test_stage3_parameters_say_whether_they_are_gathered():
    engine, m = engine_of(3)
    full = engine.engine.full_state_dict()
    assert all(isinstance(p, StatusParameter) and isinstance(p, nn.Parameter) for p in m.parameters())
    assert {p.ds_status for p in m.parameters()} == {NOT_AVAILABLE}
    seen = []
    # registered after the engine's gather hook, which is prepended: runs once the unit is gathered
    m[2].register_forward_pre_hook(lambda mod, _args: seen.append(mod.weight.ds_status))
    engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
    engine.step()
    assert seen == [AVAILABLE] and m[2].weight.ds_status is NOT_AVAILABLE  # released after the step
    with deepspeed.zero.GatheredParameters(m[2].weight):
        assert m[2].weight.ds_status is AVAILABLE and m[0].weight.ds_status is NOT_AVAILABLE
    assert m[2].weight.ds_status is NOT_AVAILABLE
    assert not torch.equal(engine.engine.full_state_dict()["2.weight"], full["2.weight"])  # it trained
    engine.close()


def test_trl_gathers_only_what_is_not_available():
    """trl.trainer.utils.maybe_gather_lm_head_ctx: gather the weights whose ds_status is not AVAILABLE, then
    read them directly (a fused LM head never calls the head module)."""
    engine, m = engine_of(3)
    full = engine.engine.full_state_dict()
    head = (m[2].weight, m[2].bias)
    to_gather = {id(p): p for p in head if p.ds_status != AVAILABLE}
    assert len(to_gather) == 2
    with deepspeed.zero.GatheredParameters(list(to_gather.values())):
        y = torch.nn.functional.linear(torch.ones(1, 8), *head)
    assert torch.equal(y, torch.nn.functional.linear(torch.ones(1, 8), full["2.weight"], full["2.bias"]))
    engine.close()


def test_a_gather_started_ahead_is_inflight():
    """Two ranks, prefetch_units=1, each Linear its own gather unit: from the second forward on, the forward of
    the first Linear starts the second's gather and the backward of the second starts the first's; until a unit
    waits for its gather (in the in-process group the data has landed, but nobody has waited), its parameters
    are INFLIGHT. Guards: GATHERING reported as AVAILABLE (or prefetch never starting a gather)."""
    def rank(group):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        cfg = zerompi.ZeroConfig(stage=3, optimizer="adamw", lr=1e-2, prefetch_units=1, bucket_mb=1e-4,
                                 **{**LOCAL, "param_persistence_threshold": 0})
        engine = zerompi.initialize(m, cfg, group=group)
        param_status.mark(engine)  # what deepspeed.initialize's engine does at stage 3
        assert [u.fqn for u in engine.sharded.units] == ["0", "2"]
        first, second = m[0].weight, m[2].weight
        seen = []

        def now(event):
            seen.append((event, first.ds_status, second.ds_status))

        def on_backward(_module, _args, out):  # after the engine's tensor hook, which gathers and prefetches
            out.register_hook(lambda _grad: now("backward 2"))

        # registered after the engine's (prepended) hooks: these run once the unit is gathered and the
        # prefetch it starts is issued
        m[0].register_forward_pre_hook(lambda *_: now("forward 0"))
        m[2].register_forward_pre_hook(lambda *_: now("forward 2"))
        m[2].register_forward_hook(on_backward)
        for _ in range(2):
            now("sharded")
            engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
            engine.step()
        now("after the step")
        engine.close()
        return seen

    recording = [("sharded", NOT_AVAILABLE, NOT_AVAILABLE), ("forward 0", AVAILABLE, NOT_AVAILABLE),
                 ("forward 2", NOT_AVAILABLE, AVAILABLE), ("backward 2", NOT_AVAILABLE, AVAILABLE)]
    prefetching = [("sharded", NOT_AVAILABLE, NOT_AVAILABLE), ("forward 0", AVAILABLE, INFLIGHT),
                   ("forward 2", NOT_AVAILABLE, AVAILABLE), ("backward 2", INFLIGHT, AVAILABLE)]
    for seen in run_ranks(2, rank):
        assert seen == recording + prefetching + [("after the step", NOT_AVAILABLE, NOT_AVAILABLE)]


@pytest.mark.parametrize("stage", (1, 2))
def test_below_stage3_parameters_have_no_status(stage):
    """DeepSpeed's ZeRO-1/2 parameters carry no ds_status either; nothing is re-classed."""
    engine, m = engine_of(stage)
    assert all(type(p) is nn.Parameter and not hasattr(p, "ds_status") for p in m.parameters())
    engine.close()


def test_a_dropped_engines_parameters_say_what_their_storage_holds():
    """Once the engine is closed and dropped (its buckets gone), a sharded parameter still views the freed
    storage of the engine's buffer: NOT_AVAILABLE, so code that trusts AVAILABLE never reads it (reading
    crashes). A parameter given new data holds its values: AVAILABLE.
    Break guarded: the dead-bucket branch answering AVAILABLE, or removed (an AttributeError)."""
    import gc
    import weakref

    engine, m = engine_of(3)
    buckets = [weakref.ref(b) for b in engine.engine.sharded.all_buckets]
    engine.close()
    del engine
    gc.collect()
    assert all(b() is None for b in buckets), "the engine's buckets outlive it: the test sees nothing"
    assert {p.ds_status for p in m.parameters()} == {NOT_AVAILABLE}
    m[2].weight.data = torch.zeros(3, 8)
    assert m[2].weight.ds_status is AVAILABLE and m[2].bias.ds_status is NOT_AVAILABLE
