"""A DeepSpeed script that builds its own optimizer, scheduler and data, run by zerompi or DeepSpeed.

Where workers/ds_script.py describes everything in the config, this script does what many
DeepSpeed training scripts do instead: it asks ``get_accelerator()`` for its device,
``deepspeed.comm`` for its rank and to average its losses, builds a ``FusedAdam`` and a
``LambdaLR`` on it, and hands them to ``initialize`` with the dataset (``training_data=``),
then trains on the loader ``initialize`` returns. ``--impl zerompi`` imports the same names
from ``zerompi.deepspeed`` and changes nothing else; ``--impl deepspeed`` runs DeepSpeed on
CPU with gloo (the peers' setup, as workers/ds_script.py); ``--impl reference`` (one process)
trains the model with plain torch AdamW on each step's global batch, as DeepSpeed's sampler
splits it, whole (``loss_ref``) and in the ranks' micro-batches (``loss_alt``).
Rank 0 writes the per-step mean losses and learning rates as JSON to ``--out``.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ds_env import deepspeed_env, exit_past_destructors
from reference_step import reference_step

p = argparse.ArgumentParser()
p.add_argument("--impl", choices=("zerompi", "deepspeed", "reference"), required=True)
p.add_argument("--out", required=True)
p.add_argument("--world", type=int, default=2, help="reference only: the world size to mimic")
args = p.parse_args()
STEPS, MICRO, ACCUM, LR = 6, 4, 2, 0.05
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 1.0,
          "steps_per_print": 1000, "wall_clock_breakdown": False,
          "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False}}
WEIGHTS = torch.linspace(-0.5, 0.5, 8).unsqueeze(1)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def make_dataset(world: int) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS * ACCUM * MICRO * world, 8, generator=g)
    return TensorDataset(x, x @ WEIGHTS)


def warmup_then_decay(k: int) -> float:
    return min(1.0, (k + 1) / 3) * 0.8 ** max(0, k - 2)


def train(deepspeed, get_accelerator, dist, FusedAdam) -> dict:  # noqa: N803  (the class, as scripts name it)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    device = get_accelerator().current_device_name()
    model = make_model()
    optimizer = FusedAdam(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_decay)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, training_data=make_dataset(dist.get_world_size()),
        config=CONFIG)
    losses, lrs = [], []
    total = torch.zeros(1, device=device)
    for i, (x, y) in enumerate(loader):
        if i % ACCUM == 0:
            lrs.append(engine.get_lr()[0])
        loss = F.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
        if (i + 1) % ACCUM == 0:
            dist.all_reduce(total)  # SUM (gloo has no AVG)
            losses.append(total.item() / (ACCUM * dist.get_world_size()))
            total.zero_()
    modules = dict(FusedAdam=FusedAdam.__module__, get_accelerator=get_accelerator.__module__, comm=dist.__name__,
                   utils=deepspeed.utils.__name__, deepspeed=deepspeed.__name__)
    return dict(losses=losses, lrs=lrs, rank=dist.get_rank(), world=dist.get_world_size(), modules=modules)


def reference() -> dict:
    """Plain torch on one process over the batches DeepSpeed's sampler gives each rank."""
    from zerompi.optim.optimizer import default_kernel  # the engine's kernel
    data = make_dataset(args.world)
    shares = [list(DataLoader(data, batch_size=MICRO, sampler=DistributedSampler(data, args.world, r, seed=0)))
              for r in range(args.world)]
    out = {}
    for name, chunked in (("loss_ref", False), ("loss_alt", True)):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01,
                                **default_kernel(torch.optim.AdamW, "cpu"))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay)
        losses, lrs = [], []
        for step in range(STEPS):
            lrs.append(opt.param_groups[0]["lr"])
            parts = [shares[r][step * ACCUM + m] for r in range(args.world) for m in range(ACCUM)]
            losses.append(reference_step(model, opt, sched, parts, chunked, CONFIG["gradient_clipping"]))
        out[name] = losses
        out["lrs"] = lrs
    return out


if args.impl == "reference":
    result = reference()
elif args.impl == "deepspeed":
    deepspeed_env()
    import logging

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import FusedAdam
    deepspeed.utils.logger.setLevel(logging.WARNING)
    result = train(deepspeed, get_accelerator, dist, FusedAdam)
else:
    import zerompi.deepspeed as deepspeed
    import zerompi.deepspeed.comm as dist
    from zerompi.deepspeed.accelerator import get_accelerator
    from zerompi.deepspeed.ops.adam import FusedAdam
    result = train(deepspeed, get_accelerator, dist, FusedAdam)
if MPI.COMM_WORLD.Get_rank() == 0:
    with open(args.out, "w") as f:
        json.dump(dict(impl=args.impl, **result), f)
if args.impl == "deepspeed":
    exit_past_destructors()
