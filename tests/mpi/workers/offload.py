"""Offload worker: none / cpu / nvme must train bitwise alike; state streams through the swap file.

For stages 1-3 and fp32/bf16 it trains the tiny GPT three times (no offload,
'cpu', 'nvme'; at stage 3 the parameters follow the optimizer's setting),
checkpoints across modes, and records what stays resident. Rank 0 writes JSON.
"""
import argparse
import os

import torch
from mpi4py import MPI

import zerompi
from common import gpt_loss, local_part, tiny_gpt, token_batches, write_json, zero_train

COMM = MPI.COMM_WORLD
MODES = ("none", "cpu", "nvme")


def config(stage, dtype, mode, swap_dir, **extra):
    return zerompi.ZeroConfig(stage=stage, dtype=dtype, optimizer="adamw", lr=1e-2, bucket_mb=0.004,
                              offload_optimizer=mode, offload_params=mode if stage == 3 else "none",
                              nvme_path=swap_dir, **extra)


def same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def parity(stage, dtype, swap_dir, batches, **extra):
    runs, rows = {}, []
    for mode in MODES:
        run, engine = zero_train(tiny_gpt(1), config(stage, dtype, mode, swap_dir, **extra), batches)
        stats = engine.stats
        runs[mode] = run.params
        rows.append(dict(mode=mode, model_state_bytes=stats.model_state_bytes, swapped=stats.swapped_bytes,
                         grad_norm=stats.last_grad_norm,
                         padded=sum(b.layout.padded_numel for b in engine.sharded.buckets),
                         read_ahead=sum(getattr(b.param_tier, "read_ahead", 0) for b in engine.sharded.buckets),
                         units=len(engine.sharded.units)))
        engine.close()
    return dict(identical={m: same(runs["none"], runs[m]) for m in MODES}, rows=rows)


def checkpoint_across_modes(stage, swap_dir, root, batches):
    """Save from an nvme-offloaded engine, load into a plain one (and back): bitwise."""
    out = {}
    for src, dst in (("nvme", "none"), ("none", "nvme")):
        a = zerompi.initialize(tiny_gpt(1), config(stage, "fp32", src, swap_dir))
        for micro in batches:
            a.backward(gpt_loss(a, local_part(micro[0], a.rank)))
            a.step()
        a.save_checkpoint(root, tag=f"{src}-{dst}")
        b = zerompi.initialize(tiny_gpt(7), config(stage, "fp32", dst, swap_dir))
        b.load_checkpoint(root, tag=f"{src}-{dst}")
        for micro in batches:  # and both keep training alike
            for e in (a, b):
                e.backward(gpt_loss(e, local_part(micro[0], e.rank)))
                e.step()
        out[f"{src}->{dst}"] = same(a.full_state_dict(), b.full_state_dict())
        a.close()
        b.close()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--swap", required=True)
    p.add_argument("--root", required=True)
    args = p.parse_args()
    batches = token_batches(3, COMM.Get_size(), 3, 1)
    result = {"parity": [], "checkpoint": {}}
    for stage in (1, 2, 3):
        for dtype in ("fp32", "bf16"):
            result["parity"].append(dict(stage=stage, dtype=dtype, **parity(stage, dtype, args.swap, batches)))
        result["checkpoint"][stage] = checkpoint_across_modes(stage, args.swap, args.root, batches)
    # accumulation (a swapped gradient shard is read, added to and written back) and clipping
    # (its norm is kept from reduction time): still bitwise
    accum = token_batches(4, COMM.Get_size(), 3, 2)
    for stage in (2, 3):
        result["parity"].append(dict(stage=stage, dtype="fp32", accum=2, **parity(
            stage, "fp32", args.swap, accum, grad_accum_steps=2, clip_grad_norm=0.05)))
    try:
        zerompi.initialize(tiny_gpt(1), config(3, "fp32", "nvme", os.path.join(args.swap, "missing")))
        message = "no error"
    except zerompi.ZeroMPIError as e:
        message = f"{type(e).__name__}: {e}"
    result["missing_dir"] = COMM.allgather(message)
    COMM.Barrier()  # each rank's close() removes its own swap file: list once every rank has closed
    result["left_behind"] = sorted(os.listdir(args.swap))
    if COMM.Get_rank() == 0:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
