"""GPU offload worker: compute on the GPU, master weights and optimizer state in pinned host memory
('cpu') or in the swap file ('nvme'), or on the GPU ('none'): one mode per job.

For stages 1-3 x fp32/bf16 (and stages 2-3 with accumulation and clipping) it
trains the tiny GPT, and rank 0 records parity against the single-process
reference on the same device, where each kind of state lives, whether the host
copies are pinned, and the final parameters (``--params``, .npz) for the
cross-mode comparison. An error at initialize (raised on every rank alike) is
recorded in the row instead of ending the job, so the other combinations still run.
"""
import itertools

import numpy as np
from mpi4py import MPI

import zerompi
from gpu_common import parser, placement, references, setup  # first: puts common on sys.path
from common import compare, engine_train, initial_params, tiny_gpt, token_batches, write_json

p = parser(__doc__)
p.add_argument("--mode", choices=("none", "cpu", "nvme"), required=True)
p.add_argument("--swap", required=True, help="nvme_path (a directory)")
p.add_argument("--params", required=True, help=".npz of the final parameters (rank 0)")
args = p.parse_args()
device = setup(args.device)
world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()

COMBOS = [(stage, dtype, 1, None) for stage, dtype in itertools.product((1, 2, 3), ("fp32", "bf16"))]
COMBOS += [(2, "fp32", 2, 0.05), (3, "fp32", 2, 0.05)]


def pinned(engine, stage: int) -> dict:
    """Whether the host copies the GPU reads and writes every step are in page-locked memory."""
    buckets = engine.sharded.buckets
    out = dict(masters=all(b.master.is_pinned() for b in buckets if b.master.device.type == "cpu"))
    if stage == 3:
        shards = [b.param_tier.tensor for b in buckets if hasattr(b.param_tier, "tensor")]  # NVMe tiers hold none
        out["param_shards"] = all(t.is_pinned() for t in shards if t.device.type == "cpu")
    return out


rows, params = [], {}
for stage, dtype, accum, clip in COMBOS:
    cfg = zerompi.ZeroConfig(stage=stage, dtype=dtype, optimizer="adamw", lr=1e-2, bucket_mb=0.004, seed=0,
                             grad_accum_steps=accum, clip_grad_norm=clip, device=args.device,
                             cuda_aware_mpi="off", offload_optimizer=args.mode,
                             offload_params=args.mode if stage == 3 else "none", nvme_path=args.swap)
    key = f"stage{stage}-{dtype}-accum{accum}"
    row = dict(key=key, stage=stage, dtype=dtype, accum=accum, clip=clip, mode=args.mode, world=world)
    model = tiny_gpt(seed=1)
    init = initial_params(model)
    batches = token_batches(5, world, args.steps, accum)
    try:
        engine = zerompi.initialize(model, cfg)
    except zerompi.ZeroMPIError as e:
        rows.append(dict(row, error=f"{type(e).__name__}: {e}"))
        continue
    ours = engine_train(engine, batches)
    stats = engine.stats
    row.update(placement(engine), pinned=pinned(engine, stage), model_state_bytes=stats.model_state_bytes,
               swapped=stats.swapped_bytes)
    if rank == 0:
        ref, alts = references(cfg, batches, world, device)
        row.update(compare(ours, ref, alts, init))
        params.update({f"{key}/{n}": t.numpy() for n, t in ours.params.items()})
        rows.append(row)
    engine.close()
if rank == 0:
    np.savez(args.params, **params)
    write_json(args.out, rows)
