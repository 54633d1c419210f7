"""A DeepSpeed script whose ranks name different checkpoint directories (from the clock, say): each
rank calls save_checkpoint with its own; zerompi writes one checkpoint into rank 0's, and every rank
loads it back. Rank 0 writes what it found as JSON to ``--out``."""
import argparse
import json
import os
import warnings

import torch
from mpi4py import MPI

import zerompi.deepspeed as deepspeed

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--root", required=True)
a = p.parse_args()
rank = MPI.COMM_WORLD.rank
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
engine.backward(engine(torch.ones(1, 4)).sum())
engine.step()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine.save_checkpoint(os.path.join(a.root, f"run-{rank}"), tag=f"t{rank}")
before = {n: t.clone() for n, t in engine.engine.full_state_dict().items()}
path, _ = engine.load_checkpoint(os.path.join(a.root, "run-0"), tag="t0")
same = all(torch.equal(before[n], t) for n, t in engine.engine.full_state_dict().items())
if rank == 0:
    with open(a.out, "w") as f:
        json.dump(dict(dirs=sorted(os.listdir(a.root)), same=same, loaded=str(path),
                       warned=[str(w.message) for w in caught if "different places" in str(w.message)]), f)
