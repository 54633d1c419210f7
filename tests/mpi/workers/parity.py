"""Parity matrix worker: stages 0-3 x dtype x grad accumulation x clipping, on this world size.

Every combination trains a tiny GPT (tied embeddings, several stage-3 units)
for a few steps through the engine and through the single-process reference
on the same global batches, and rank 0 records the differences and the
engine's communication and memory counters. tests/mpi/test_parity.py judges them.
"""
import argparse
import itertools

import torch
from mpi4py import MPI

import zerompi
from common import compare, digest, initial_params, references, tiny_gpt, token_batches, write_json, zero_train
from mutation import MUTATIONS, mutate

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--hierarchy", default="flat")
p.add_argument("--ranks-per-node", type=int, default=None)
p.add_argument("--quick", action="store_true", help="fp32, no accumulation, no clipping only")
p.add_argument("--fp32", action="store_true", help="fp32 only, with accumulation and clipping")
p.add_argument("--stages", help="comma list of stages (default: all the hierarchy allows)")
p.add_argument("--combos", help="comma list of dtype/accum/clip/optimizer (clip '-' for none), e.g. fp32/2/0.05/sgd: "
                                "these per stage instead of the whole product")
p.add_argument("--overlap", choices=("test", "thread"),
               help="non-blocking reduce-scatter and prefetch, progressed by MPI_Test or a communication thread")
p.add_argument("--threads", type=int, default=None, help="torch threads per rank (cpu_threads)")
p.add_argument("--persistence", type=int, default=0, help="stage 3: param_persistence_threshold")
p.add_argument("--max-live", type=int, default=None, help="stage 3: max_live_params")
p.add_argument("--mutate", choices=sorted(MUTATIONS),
               help="break the gradient reduction on purpose (the parity bounds must catch it)")
args = p.parse_args()
if args.mutate:
    mutate(args.mutate)
STAGES = {"flat": range(4), "hsdp": range(1, 4), "hpz": (3,)}[args.hierarchy]
if args.stages:
    STAGES = [int(x) for x in args.stages.split(",")]
world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()

results = []
# Adam is nearly invariant to the scale of the gradient, so a wrong averaging factor
# would hide behind it; SGD with momentum exposes it. Both run every combination.
# AdamW with torch's default betas and eps.
OPTIMIZERS = {"adamw": dict(optimizer="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
              "sgd": dict(optimizer="sgd", lr=0.5, momentum=0.9, weight_decay=0.1)}
DTYPES, ACCUMS, CLIPS = (("fp32",), (1,), (None,)) if args.quick else (("fp32", "bf16"), (1, 2), (None, 0.05))
if args.fp32:
    DTYPES = ("fp32",)
COMBOS = list(itertools.product(DTYPES, ACCUMS, CLIPS, OPTIMIZERS))
if args.combos:
    COMBOS = [(d, int(a), None if c == "-" else float(c), o)
              for d, a, c, o in (x.split("/") for x in args.combos.split(","))]
for stage, (dtype, accum, clip, opt) in itertools.product(STAGES, COMBOS):
    cfg = zerompi.ZeroConfig(stage=stage, dtype=dtype, grad_accum_steps=accum, clip_grad_norm=clip,
                             bucket_mb=0.004, seed=0, hierarchy=args.hierarchy,
                             ranks_per_node=args.ranks_per_node, cpu_threads=args.threads, **OPTIMIZERS[opt],
                             param_persistence_threshold=args.persistence, max_live_params=args.max_live,
                             **(dict(overlap_grad_reduce=True, prefetch_units=2, mpi_progress=args.overlap)
                                if args.overlap else {}))
    model = tiny_gpt(seed=1)
    init = initial_params(model)
    batches = token_batches(7, world, args.steps, accum)
    ours, engine = zero_train(model, cfg, batches)
    ref, alts = references(MPI.COMM_WORLD, lambda: tiny_gpt(seed=1), cfg, batches)
    if rank == 0:
        layouts = [b.layout for b in engine.sharded.buckets]
        stats = engine.stats
        results.append(dict(
            stage=stage, dtype=dtype, accum=accum, clip=clip, optimizer=opt, world=world, steps=args.steps,
            hierarchy=args.hierarchy, ranks_per_node=args.ranks_per_node,
            mutation=args.mutate, digest=digest(ours), **compare(ours, ref, alts, init),
            bytes_sent=stats.bytes_sent, model_state_bytes=stats.model_state_bytes,
            numel=sum(lay.numel for lay in layouts), padded=sum(lay.padded_numel for lay in layouts),
            buckets=len(layouts), units=len(engine.sharded.units),
            persistent_padded=sum(b.layout.padded_numel for b in engine.sharded.buckets
                                  if stage == 3 and not b.plan.shard_params),
            optimizer_state_bytes=engine.optimizer.state_bytes(),
            # what the variants of test_parity_variants set, as the rank's kernels saw it
            threads=torch.get_num_threads(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
        ))
    engine.close()
if rank == 0:
    write_json(args.out, results)
