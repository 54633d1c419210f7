"""zerompi.shard.deferred without MPI: what may be on the meta device, and how a module becomes real."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerompi.shard.deferred import Materializer, check, to_device
from zerompi.shard.placement import place
from zerompi.shard.stages import plan_for
from zerompi.errors import UsageError


def _bucketed(m: nn.Module, stage: int, threshold: int = 0) -> set[str]:
    placed = place([(n, tuple(p.shape), p.requires_grad) for n, p in m.named_parameters()], plan_for(stage),
                   threshold, {n: 0 for n, _ in m.named_parameters()})
    return {pl.fqn for pl in placed if pl.bucketed}


def test_frozen_parameters_and_buffers_must_be_real():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(UsageError, match="1.running_mean"):
        check(m, _bucketed(m, 2))
    m[1].weight.requires_grad_(False)
    m[1].running_mean, m[1].running_var = torch.zeros(2), torch.ones(2)
    m[1].num_batches_tracked = torch.zeros((), dtype=torch.long)
    with pytest.raises(UsageError, match="1.weight"):
        check(m, _bucketed(m, 2))          # stages 0-2 replicate a frozen parameter: it must be real
    check(m, _bucketed(m, 3))              # stage 3 shards it: it may wait for its bucket
    with pytest.raises(UsageError, match="1.weight"):
        check(m, _bucketed(m, 3, threshold=3))  # below the persistence threshold it is replicated


def test_materialize_keeps_parameter_objects_and_runs_param_init():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    m = to_device(m, torch.device("cpu"))  # meta tensors wait
    weight = m[0].weight
    seen = []
    Materializer(m, torch.device("cpu"), lambda mod: (seen.append(mod), nn.init.ones_(mod.weight),
                                                       nn.init.zeros_(mod.bias)))("0.weight")
    assert m[0].weight is weight and not weight.is_meta and torch.equal(weight, torch.ones(4, 3))
    assert seen == [m[0]] and m[1].weight.is_meta  # only the owner of that parameter


def test_tied_weight_keeps_its_values_when_its_second_module_is_materialized():
    with torch.device("meta"):
        emb, out = nn.Embedding(5, 3), nn.Linear(3, 5)
    out.weight = emb.weight
    m = nn.ModuleDict(dict(emb=emb, out=out))
    mat = Materializer(m, torch.device("cpu"), None)  # reset_parameters()
    mat("emb.weight")
    before = emb.weight.detach().clone()
    mat("out.bias")  # out.reset_parameters() also draws a weight: it must not land in emb.weight
    assert torch.equal(emb.weight, before) and out.weight is emb.weight and not out.bias.is_meta


def test_modules_without_reset_parameters_need_param_init():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(2))
    with torch.device("meta"):
        m = nn.Sequential(Bare())
    with pytest.raises(UsageError, match="param_init="):
        Materializer(m, torch.device("cpu"), None)("0.w")
    with torch.device("meta"):
        fresh = nn.Sequential(Bare())
    with pytest.raises(UsageError, match="left w of module '0' on the meta device"):
        Materializer(fresh, torch.device("cpu"), lambda mod: torch.utils.swap_tensors(
            mod.w, nn.Parameter(torch.empty(2, device="meta"))))("0.w")


def test_frozen_parameters_are_made_in_the_dtype_their_bucket_keeps():
    """Stage 3 keeps frozen parameters in the compute dtype only: param_init writes them there, and
    the trainable ones of the same module stay fp32 (their master's values)."""
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(3, 4))
    m[0].weight.requires_grad_(False)
    seen = {}
    Materializer(m, torch.device("cpu"), lambda mod: seen.update(w=mod.weight.dtype, b=mod.bias.dtype),
                 frozen_dtype=torch.bfloat16)("0.weight")
    assert seen == {"w": torch.bfloat16, "b": torch.float32}
    assert m[0].weight.dtype == torch.bfloat16 and not m[0].weight.requires_grad
