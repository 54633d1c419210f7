"""Estimate worker: the engine's memory and traffic counters after one step, next to zerompi.tools.estimate.

For stages 0-3 x fp32/bf16 x AdamW/SGD-with-momentum, a tiny GPT (several
buckets, so padding occurs at odd world sizes) takes one optimizer step.
Rank 0 writes one JSON row per combination with every rank's
``model_state_bytes``, the true and padded parameter counts, the bytes sent,
and zerompi.tools.estimate evaluated at both counts; tests/mpi/test_estimate_mpi.py judges them.
"""
import argparse
import itertools

from mpi4py import MPI

import zerompi
from common import gpt_loss, local_part, tiny_gpt, token_batches, write_json
from zerompi.tools.estimate import communication_per_step, model_state_bytes

COMM = MPI.COMM_WORLD
WORLD, RANK = COMM.Get_size(), COMM.Get_rank()
OPTIMIZERS = {"adamw": dict(optimizer="adamw", lr=1e-3), "sgd": dict(optimizer="sgd", lr=0.1, momentum=0.9)}
TRAFFIC = ("all_reduce", "reduce_scatter", "all_gather")


def estimate_at(numel: int, stage: int, dtype: str, opt: str) -> dict:
    m = model_state_bytes(numel, WORLD, stage, dtype, opt)
    comm = communication_per_step(numel, WORLD, stage, dtype)
    return dict(m._asdict(), total=m.total, comm_bytes=comm.bytes)


p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

rows = []
for stage, dtype, opt in itertools.product(range(4), ("fp32", "bf16"), OPTIMIZERS):
    cfg = zerompi.ZeroConfig(stage=stage, dtype=dtype, bucket_mb=0.004, seed=0, **OPTIMIZERS[opt])
    model = tiny_gpt(seed=1)
    model_numel = sum(q.numel() for q in model.parameters() if q.requires_grad)
    engine = zerompi.initialize(model, cfg)
    (batch,) = token_batches(5, WORLD, 1, 1)[0]
    engine.backward(gpt_loss(engine, local_part(batch, engine.rank)))
    engine.step()
    stats = engine.stats
    layouts = [b.layout for b in engine.sharded.buckets]
    numel, padded = sum(lay.numel for lay in layouts), sum(lay.padded_numel for lay in layouts)
    per_rank = COMM.gather(stats.model_state_bytes, root=0)
    sent = COMM.gather(sum(stats.bytes_sent.get(k, 0) for k in TRAFFIC), root=0)
    engine.close()
    if RANK == 0:
        est = {name: estimate_at(n, stage, dtype, opt) for name, n in (("padded", padded), ("true", numel))}
        rows.append(dict(stage=stage, dtype=dtype, optimizer=opt, world=WORLD, model_numel=model_numel,
                         numel=numel, padded=padded, buckets=len(layouts), model_state_bytes=per_rank,
                         bytes_sent=sent, estimate=est))
if RANK == 0:
    write_json(args.out, rows)
