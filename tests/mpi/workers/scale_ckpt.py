"""Checkpoints across large world sizes: save at one (per-rank and per-node layouts), load at another.

--mode save: train 2 steps at stage 3 (the tiny GPT, 2 rows per rank), save under ROOT/<layout>
             (per_node with --ranks-per-node ranks per emulated node); rank 0 writes the
             parameters at the save to OUT (.npz).
--mode load: a model with other initial values loads ROOT/<layout> for every layout, rank 0 writes
             the loaded parameters to OUT (.npz, keys <layout>/<name>), then every engine trains one
             more step from the loaded state (the optimizer state must fit this world size).
"""
import argparse

import numpy as np
import torch
from mpi4py import MPI

import zerompi
from common import SEQ, VOCAB, gpt_loss, tiny_gpt

LAYOUTS = ("per_rank", "per_node")
p = argparse.ArgumentParser()
p.add_argument("--mode", choices=("save", "load"), required=True)
p.add_argument("--root", required=True)
p.add_argument("--out", required=True)
p.add_argument("--ranks-per-node", type=int, default=None)
args = p.parse_args()
comm = MPI.COMM_WORLD


def step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 1000 + engine.rank)
    data = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    engine.backward(gpt_loss(engine, (data[:, :-1].contiguous(), data[:, 1:].contiguous())))
    engine.step()


def engine_for(layout: str, seed: int):
    cfg = zerompi.ZeroConfig(stage=3, optimizer="sgd", lr=0.1, momentum=0.9, seed=0, cpu_threads=1,
                             bucket_mb=0.004, checkpoint_layout=layout, ranks_per_node=args.ranks_per_node)
    return zerompi.initialize(tiny_gpt(seed), cfg)


out = {}
for layout in LAYOUTS:
    if args.mode == "save":
        engine = engine_for(layout, 0)
        step(engine, 1)
        step(engine, 2)
        engine.save_checkpoint(f"{args.root}/{layout}", "t")
    else:
        engine = engine_for("per_rank", 5)  # other initial values: everything must come from the file
        engine.load_checkpoint(f"{args.root}/{layout}", "t")
    full = engine.full_state_dict()
    out.update({f"{layout}/{n}": t.numpy() for n, t in full.items()})
    if args.mode == "load":
        step(engine, 3)
        out[f"{layout}/steps"] = np.asarray(engine.stats.steps)
    engine.close()
if comm.Get_rank() == 0:
    np.savez(args.out, **out)
