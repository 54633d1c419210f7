"""A training script written against DeepSpeed's API, run by zerompi or by DeepSpeed itself.

``--impl zerompi`` swaps ``import deepspeed`` for ``import zerompi.deepspeed as deepspeed``
and changes nothing else; ``--impl deepspeed`` (the peers venv, benchmarks/.venv-peers)
starts DeepSpeed on CPU with gloo, as benchmarks/peers/run_deepspeed.py does. Both train
the same MLP on the same batches (rank r's micro-batch m of step s is drawn from a generator
seeded by (s, r, m)) with the same config, save a checkpoint, and load it into a fresh engine.
``--impl reference`` (one process) trains the same model with plain torch on each step's
global batch in two summation orders: as one batch (``loss_ref``), and cut into the ranks'
micro-batches, their gradients summed (``loss_alt``): the order noise the parity bound uses.
Rank 0 writes the per-step mean losses and learning rates as JSON to ``--out``.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from ds_env import deepspeed_env, exit_past_destructors
from reference_step import reference_step

p = argparse.ArgumentParser()
p.add_argument("--impl", choices=("zerompi", "deepspeed", "reference"), required=True)
p.add_argument("--out", required=True)
p.add_argument("--ckpt")
p.add_argument("--world", type=int, default=2, help="reference only: the world size to mimic")
args = p.parse_args()
comm = MPI.COMM_WORLD
STEPS, MICRO, ACCUM = 10, 4, 2
CONFIG = {
    "train_batch_size": MICRO * ACCUM * (comm.Get_size() if args.impl != "reference" else args.world),
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
    "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                              "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": STEPS, "warmup_num_steps": 2,
                                                      "warmup_min_lr": 0.002, "warmup_max_lr": 0.02,
                                                      "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False},
}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


WEIGHTS = torch.linspace(-0.5, 0.5, 8).unsqueeze(1)  # the target: a linear map the MLP learns in a few steps


def micro_batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(MICRO, 8, generator=g)
    return x, x @ WEIGHTS


def eval_batch():
    g = torch.Generator().manual_seed(99)
    x = torch.randn(32, 8, generator=g)
    return x, x @ WEIGHTS


def start_deepspeed():
    """DeepSpeed on CPU with gloo (ds_env.py)."""
    deepspeed_env()
    import logging

    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return deepspeed


def train(deepspeed) -> dict:
    rank = comm.Get_rank()
    model = make_model()
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                              config=CONFIG)
    losses, lrs = [], []
    for step in range(STEPS):
        lrs.append(engine.get_lr()[0])
        total = 0.0
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = micro_batch(step, rank, micro)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(comm.allreduce(total / ACCUM) / comm.Get_size())
    out = dict(losses=losses, lrs=lrs)
    if args.ckpt:
        out.update(checkpoint(deepspeed, engine))
    return out


def eval_loss(engine) -> float:
    engine.eval()
    with torch.no_grad():
        x, y = eval_batch()
        return F.mse_loss(engine(x), y).item()


def checkpoint(deepspeed, engine) -> dict:
    """Save, load into a fresh engine (other initial weights), and compare what both compute."""
    engine.save_checkpoint(args.ckpt, client_state={"step": STEPS})
    trained = eval_loss(engine)
    fresh_model = make_model(seed=7)
    fresh, *_ = deepspeed.initialize(model=fresh_model, model_parameters=fresh_model.parameters(), config=CONFIG)
    before = eval_loss(fresh)
    path, client_state = fresh.load_checkpoint(args.ckpt)
    return dict(eval_trained=trained, eval_fresh=before, eval_loaded=eval_loss(fresh), load_path=str(path),
                client_state=client_state, lr_loaded=fresh.get_lr()[0], lr_trained=engine.get_lr()[0])


def reference() -> dict:
    """Plain torch on one process: the global batch whole, and in the ranks' micro-batches."""
    from zerompi.compat.deepspeed.schedule import read_schedule
    from zerompi.compat.deepspeed.lr_schedules import scheduler_factory
    from zerompi.optim.optimizer import default_kernel  # the engine's kernel
    out = {}
    for name, chunked in (("loss_ref", False), ("loss_alt", True)):
        model = make_model()
        params = CONFIG["optimizer"]["params"]
        opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=params["betas"], eps=params["eps"],
                                weight_decay=params["weight_decay"], **default_kernel(torch.optim.AdamW, "cpu"))
        sched = scheduler_factory(read_schedule(CONFIG, False))(opt)
        losses = []
        for step in range(STEPS):
            parts = [micro_batch(step, r, m) for r in range(args.world) for m in range(ACCUM)]
            losses.append(reference_step(model, opt, sched, parts, chunked, CONFIG["gradient_clipping"]))
        out[name] = losses
    return out


if args.impl == "reference":
    result = reference()
elif args.impl == "deepspeed":
    result = train(start_deepspeed())
else:
    import zerompi.deepspeed as deepspeed
    deepspeed.init_distributed()
    result = train(deepspeed)
if comm.Get_rank() == 0:
    with open(args.out, "w") as f:
        json.dump(dict(impl=args.impl, world=comm.Get_size(), **result), f)
if args.impl == "deepspeed":
    exit_past_destructors()
