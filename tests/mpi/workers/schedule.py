"""Learning-rate schedules on the engine against single-process PyTorch, on this world size.

For each stage: the config's warm-up + cosine schedule, and a user scheduler (torch's
SequentialLR of LinearLR then ExponentialLR, through ``initialize(lr_scheduler=fn)``) on two
param groups, each trained 6 steps through the engine and through the reference with the
same scheduler. Rank 0 records each step's learning rates on both sides and the parameter
parity (with the order noise, see common.compare). --mode save: the uninterrupted run, then 3
steps and a save; --mode resume: a new engine (other initial values) loads and trains the last 3.
The learning rates must be those of the uninterrupted run at any world size; at the same world
size (same batches) the losses and parameters too, bitwise.
"""
import argparse

import torch
from mpi4py import MPI

import zerompi
from common import compare, engine_train, initial_params, references, tiny_gpt, token_batches, write_json, zero_train

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=("parity", "save", "resume"), default="parity")
p.add_argument("--root")
p.add_argument("--stages", default="0,1,2,3")
args = p.parse_args()
world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
STEPS, SAVE_AT = 6, 3
STAGES = [int(s) for s in args.stages.split(",")]


def groups(model):
    """Biases and norms without weight decay and at another lr: two groups, as users write them."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]


def user_scheduler(opt):
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])


def config(stage: int, schedule: str) -> zerompi.ZeroConfig:
    extra = dict(lr_schedule="warmup_cosine", warmup_steps=2, total_steps=5, min_lr=1e-4) \
        if schedule == "config" else {}
    return zerompi.ZeroConfig(stage=stage, optimizer="adamw", lr=1e-2, weight_decay=0.1, bucket_mb=0.004,
                              seed=0, clip_grad_norm=0.5, **extra)


def factory(cfg, schedule):
    from zerompi.optim.schedules import from_policy
    return from_policy(cfg.lr_policy) if schedule == "config" else user_scheduler


results = []
batches = token_batches(11, world, STEPS, 1)
for stage in STAGES:
    for schedule in ("config", "user"):
        cfg = config(stage, schedule)
        sched = None if schedule == "config" else user_scheduler
        row = dict(stage=stage, schedule=schedule, world=world)
        if args.mode == "parity":
            model = tiny_gpt(seed=1)
            init = initial_params(model)
            lrs = []
            ours, engine = zero_train(model, cfg, batches, param_groups=groups, lr_scheduler=sched, lrs=lrs)
            engine.close()
            ref_lrs = []
            ref, alts = references(MPI.COMM_WORLD, lambda: tiny_gpt(seed=1), cfg, batches, lrs=ref_lrs,
                                   param_groups=groups, lr_scheduler=factory(cfg, schedule))
            if rank == 0:
                row.update(lrs=lrs, ref_lrs=ref_lrs, dtype="fp32", **compare(ours, ref, alts, init))
        else:
            model = tiny_gpt(seed=1 if args.mode == "save" else 5)
            engine = zerompi.initialize(model, cfg, lr_scheduler=sched, param_groups=groups(model))
            root = f"{args.root}/s{stage}-{schedule}"
            lrs = []
            if args.mode == "save":
                full = engine_train(engine, batches, lrs=lrs)
                engine.close()
                model = tiny_gpt(seed=1)
                engine = zerompi.initialize(model, cfg, lr_scheduler=sched, param_groups=groups(model))
                engine_train(engine, batches[:SAVE_AT])
                engine.save_checkpoint(root)
                row.update(lrs=lrs, losses=full.losses,
                           params={n: t.flatten()[:64].tolist() for n, t in full.params.items()})
            else:
                engine.load_checkpoint(root)
                run = engine_train(engine, batches[SAVE_AT:], lrs=lrs)
                row.update(lrs=lrs, losses=run.losses,
                           params={n: t.flatten()[:64].tolist() for n, t in run.params.items()})
            engine.close()
        results.append(row)
if rank == 0:
    write_json(args.out, results)
