"""``deepspeed.zero.GatheredParameters(params, modifier_rank=0)`` with the parameters in another order on
each rank (a set's order differs per process), before ``initialize`` (zero.Init's meta parameters, one
module without ``reset_parameters``) and after it (an engine's buckets and a small replicated parameter):
every rank must end with rank 0's values, in the right parameters."""
import argparse
import json

import torch
from mpi4py import MPI
from torch import nn

import zerompi.deepspeed as deepspeed


class Scale(nn.Module):  # no reset_parameters(): zero.Init leaves it to whoever writes it
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank = MPI.COMM_WORLD.Get_rank()
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 8},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = nn.Sequential(nn.Linear(4, 6), Scale(6), nn.Linear(6, 3))
    params = list(model.parameters())
    mine = params if rank == 0 else params[::-1]
    with deepspeed.zero.GatheredParameters(mine, modifier_rank=0):
        if rank == 0:
            for k, q in enumerate(params):
                q.data.copy_(torch.full_like(q, float(k + 1)))
    before = [float(q.data.mean()) for q in params]
    engine, *_ = deepspeed.initialize(model=model, config=cfg, overrides={"device": "cpu", "cpu_threads": 1})
    params = list(engine.module.parameters())
    mine = params if rank == 0 else params[::-1]
    with deepspeed.zero.GatheredParameters(mine, modifier_rank=0):
        if rank == 0:
            for k, q in enumerate(params):
                q.data.copy_(torch.full_like(q, float(10 * (k + 1))))
    after = [float(v.mean()) for v in engine.engine.full_state_dict().values()]
    results = MPI.COMM_WORLD.gather(dict(before=before, after=after), root=0)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
