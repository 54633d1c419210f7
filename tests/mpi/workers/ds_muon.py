"""DeepSpeed's ``"optimizer": {"type": "Muon"}`` trained by zerompi or by DeepSpeed 0.19.8, at each stage.

``--impl zerompi`` and ``--impl deepspeed`` run the same script (DeepSpeed's API) on 2 ranks, one engine
per ZeRO stage in ``--stages``, on the same batches (rank r's micro-batch m of step s drawn from a
generator seeded by (s, r, m)); rank 0 writes each stage's per-step mean losses and final weights.
``--impl reference`` (one process) trains the same model with plain torch and zerompi's Muon (ops/muon.py)
on each step's global batch, in three summation orders: whole (``ref``), as the ranks' micro-batches
(``alt``), and those in reverse (``rev``); ``alt`` and ``rev`` differ from ``ref`` by order alone, which
bounds what a distributed run may differ by (tests/mpi/tolerance.py). Each run also writes the dtype its
Newton-Schulz iterates in on this CPU (``ns_dtype``), so the test can see that all three ran the same.

The model has a tall (16x8), a square (16x16) and a wide (4x16) matrix, so each path of DeepSpeed's
Newton-Schulz runs, and biases for the Adam half; muon_lr and adam_lr differ, so a half that took the
other's settings shows. torch_adam makes DeepSpeed's Adam half torch's AdamW, the arithmetic zerompi runs.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from ds_env import deepspeed_env, exit_past_destructors
from mpi4py import MPI
from reference_step import reference_step
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--impl", choices=("zerompi", "deepspeed", "reference"), required=True)
p.add_argument("--out", required=True)
p.add_argument("--stages", default="0,1,2,3")
p.add_argument("--world", type=int, default=2, help="reference only: the world size to mimic")
args = p.parse_args()
comm = MPI.COMM_WORLD
torch.set_num_threads(1)
STEPS, MICRO, ACCUM = 8, 4, 2
PARAMS = {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 0.005, "momentum": 0.9, "weight_decay": 0.01,
          "torch_adam": True}


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": 0.0, "steps_per_print": 1000, "wall_clock_breakdown": False,
            "optimizer": {"type": "Muon", "params": PARAMS},
            # DeepSpeed refuses Muon with its stage-3 reduce-scatter; zerompi has no such switch.
            "zero_optimization": {"stage": stage, "reduce_scatter": False}}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


TARGET = torch.linspace(-1, 1, 32).view(8, 4)


def micro_batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(MICRO, 8, generator=g)
    return x, torch.tanh(x @ TARGET)


def weights(deepspeed, engine) -> dict:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().clone().tolist() for n, p in engine.module.named_parameters()}


def train(deepspeed, stage: int) -> dict:
    rank = comm.Get_rank()
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUM):
            x, y = micro_batch(step, rank, micro)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(comm.allreduce(total / ACCUM) / comm.Get_size())
    return {"losses": losses, "weights": weights(deepspeed, engine)}


class Pair:
    """zerompi's Muon on the matrices DeepSpeed tags, torch's AdamW on the rest, stepped as one."""

    def __init__(self, model: nn.Module):
        from zerompi.compat.deepspeed.muon import tag
        from zerompi.compat.deepspeed.ops.muon import Muon
        tag(model)
        mats = [q for q in model.parameters() if q.use_muon]
        rest = [q for q in model.parameters() if not q.use_muon]
        self.parts = [Muon(mats, lr=PARAMS["muon_lr"], momentum=PARAMS["momentum"], weight_decay=PARAMS["weight_decay"]),
                      torch.optim.AdamW(rest, lr=PARAMS["adam_lr"], betas=(0.9, 0.95), eps=1e-10,
                                        weight_decay=PARAMS["weight_decay"])]

    def step(self):
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)


class NoSchedule:
    def step(self):
        pass


def reference() -> dict:
    out = {}
    for name in ("ref", "alt", "rev"):
        model = make_model()
        opt, losses = Pair(model), []
        for step in range(STEPS):
            parts = [micro_batch(step, r, m) for r in range(args.world) for m in range(ACCUM)]
            parts = parts[::-1] if name == "rev" else parts
            losses.append(reference_step(model, opt, NoSchedule(), parts, name != "ref", float("inf")))
        out[name] = {"losses": losses, "weights": {n: q.detach().tolist() for n, q in model.named_parameters()}}
    return out


def start_deepspeed():
    deepspeed_env()
    import logging

    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return deepspeed


def ns_dtype() -> str:
    """The dtype this implementation's gram Newton-Schulz iterates in on this CPU."""
    if args.impl == "deepspeed":
        from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype
        return str(ns_compute_dtype("gram"))
    from zerompi.compat.deepspeed.ops.muon import ns_dtype as ours
    return str(ours("gram", torch.device("cpu")))


stages = [int(s) for s in args.stages.split(",")]
if args.impl == "reference":
    result = reference()
else:
    if args.impl == "deepspeed":
        ds = start_deepspeed()
    else:
        import zerompi.deepspeed as ds
        ds.init_distributed()
    result = {str(stage): train(ds, stage) for stage in stages}
if comm.Get_rank() == 0:
    with open(args.out, "w") as f:
        json.dump(dict(impl=args.impl, world=comm.Get_size(), ns_dtype=ns_dtype(), **result), f)
if args.impl == "deepspeed":
    exit_past_destructors()
