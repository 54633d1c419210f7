"""A DeepSpeed training script in the style of DeepSpeed's examples, for DeepSpeed itself.

It imports ``deepspeed``, reads ``--deepspeed_config``, asks ``torch.distributed`` (not
``deepspeed.comm``) for its rank and world size and averages its losses with
``torch.distributed.all_reduce``, builds its own AdamW and LambdaLR and passes them to
``initialize``, and runs ``loss.backward()`` (not ``engine.backward``) then ``engine.step()``:
on a loss it computes from the model's output, or (``--loss inside``) on the ``"loss"`` the model
returns beside its prediction, as transformers' models do (``--backward engine``: ``engine.backward(loss)``). tests/mpi/test_ds_torch_script.py runs it unchanged under DeepSpeed and under
``python -m zerompi.deepspeed``, and with its one import changed under ``python -m mpi4py``.
Rank 0 writes the per-step mean losses and learning rates as JSON to ``--out``.
"""
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

import deepspeed
from ds_torch_model import ACCUM, STEPS, Net, make_optimizer, make_scheduler, micro_batch

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--loss", choices=("outside", "inside"), default="outside")
parser.add_argument("--backward", choices=("loss", "engine"), default="loss")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
model = Net()
optimizer = make_optimizer(model.parameters())
scheduler = make_scheduler(optimizer)
engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                       lr_scheduler=scheduler)
losses, lrs = [], []
for step in range(STEPS):
    lrs.append(engine.get_lr()[0])
    total = torch.zeros(1)
    for micro in range(ACCUM):
        x, y = micro_batch(step, rank, micro)
        if args.loss == "inside":
            loss = engine(x, y)["loss"]
        else:
            loss = F.mse_loss(engine(x), y)
        if args.backward == "engine":
            engine.backward(loss)
        else:
            loss.backward()
        engine.step()
        total += loss.detach()
    dist.all_reduce(total)
    losses.append(total.item() / (ACCUM * world))
dist.barrier()
if rank == 0:
    with open(args.out, "w") as f:
        json.dump(dict(losses=losses, lrs=lrs, world=world, backend=dist.get_backend()), f)
