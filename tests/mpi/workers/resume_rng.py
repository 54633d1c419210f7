"""Resume with dropout: does the RNG state come back, so that training continues bitwise?

For each of --stages (one job covers them all: starting a job costs more than training):
--mode save:   a GPT with dropout > 0 trains --steps steps uninterrupted (the reference);
               then a second engine, built the same way, trains the first --save-at steps
               and saves under ROOT/s{stage}. Rank 0 writes to OUT (.npz): every rank's loss
               at every step of both engines, and the reference's final parameters.
--mode resume: a fresh model with other initial values loads the checkpoint and trains the
               remaining steps ("resumed"); then it loads again, reseeds rank r with
               seed + r (what a load that restores no RNG state leaves behind) and trains
               the same steps ("control": shows that dropout makes the RNG matter).
Keys of OUT: s{stage}/{ref,save,resumed,control}_losses and s{stage}/{ref,resumed,control}/{param}.
"""
import argparse

import numpy as np
import torch
from mpi4py import MPI

import zerompi
from zerompi.comm import launch
from common import SEQ, VOCAB, gpt_loss, tiny_gpt

GLOBAL = 8  # sequences per step, split evenly over the ranks
COMM = MPI.COMM_WORLD


def global_batch(step: int):
    g = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def train(engine, first: int, stop: int) -> np.ndarray:
    """Steps ``first..stop-1``; returns every rank's loss per step, shape (steps, world), on all ranks."""
    rows = GLOBAL // engine.world_size
    mine = []
    for step in range(first, stop):
        x, y = (t[engine.rank * rows:(engine.rank + 1) * rows] for t in global_batch(step))
        loss = gpt_loss(engine, (x, y))
        engine.backward(loss)
        engine.step()
        mine.append(loss.detach().float().item())
    return np.array(COMM.allgather(mine), dtype=np.float32).T.reshape(stop - first, engine.world_size)


def final(engine, prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}/{k}": v.numpy() for k, v in engine.full_state_dict().items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("save", "resume"), required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stages", type=int, nargs="+", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.2)
    args = p.parse_args()
    out: dict[str, np.ndarray] = {}
    for stage in args.stages:
        out.update(run_stage(args, stage))
    if COMM.Get_rank() == 0:
        np.savez(args.out, **out)


def run_stage(args, stage: int) -> dict[str, np.ndarray]:
    cfg = zerompi.ZeroConfig(stage=stage, optimizer="adamw", lr=1e-2, weight_decay=0.1, bucket_mb=0.004,
                             cpu_threads=1, seed=7, checkpoint_layout="per_rank")
    root = f"{args.root}/s{stage}"

    def engine(model_seed: int):
        return zerompi.initialize(tiny_gpt(model_seed, dropout=args.dropout), cfg)

    out: dict[str, np.ndarray] = {}
    if args.mode == "save":
        ref = engine(1)
        out["ref_losses"] = train(ref, 0, args.steps)
        out.update(final(ref, "ref"))
        ref.close()
        first = engine(1)
        out["save_losses"] = train(first, 0, args.save_at)
        first.save_checkpoint(root, client_state={"next_step": args.save_at})
        first.close()
    else:
        for name in ("resumed", "control"):
            e = engine(9)  # other initial values: everything must come from the checkpoint
            state = e.load_checkpoint(root)
            if name == "control":
                launch.seed_rank(cfg.seed, e.rank)
            out[f"{name}_losses"] = train(e, state["next_step"], args.steps)
            out.update(final(e, name))
            e.close()
    return {f"s{stage}/{k}": v for k, v in out.items()}


if __name__ == "__main__":
    main()
