"""GPU parity worker: stages 0-3 x fp32/bf16 x accumulation/clipping x AdamW/SGD on CUDA tensors.

One ``cuda_aware_mpi`` setting per job: 'off' stages every collective through
pinned host memory, 'on' hands device pointers to MPI. An MPI that reports no
CUDA support refuses 'on' at initialize (ConfigError); rank 0 then writes
``{"skipped": message}`` instead of rows. tests/gpu/test_gpu_parity.py judges the rows.
"""
import itertools

from mpi4py import MPI

import zerompi
from gpu_common import parser, placement, references, setup  # first: puts common on sys.path
from common import compare, engine_train, initial_params, tiny_gpt, token_batches, write_json

p = parser(__doc__)
p.add_argument("--cuda-aware", choices=("off", "on"), required=True)
args = p.parse_args()
device = setup(args.device)
world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()

OPTIMIZERS = {"adamw": dict(optimizer="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
              "sgd": dict(optimizer="sgd", lr=0.5, momentum=0.9, weight_decay=0.1)}
# (accumulation, clipping): the plain step, and the swapped-norm and accumulated-gradient paths
SCHEDULES = ((1, None), (2, 0.05))
rows, skipped = [], None
for stage, dtype, (accum, clip), opt in itertools.product(range(4), ("fp32", "bf16"), SCHEDULES, OPTIMIZERS):
    cfg = zerompi.ZeroConfig(stage=stage, dtype=dtype, grad_accum_steps=accum, clip_grad_norm=clip,
                             bucket_mb=0.004, seed=0, device=args.device, cuda_aware_mpi=args.cuda_aware,
                             **OPTIMIZERS[opt])
    model = tiny_gpt(seed=1)
    init = initial_params(model)
    batches = token_batches(7, world, args.steps, accum)
    try:
        engine = zerompi.initialize(model, cfg)
    except zerompi.ConfigError as e:  # every rank asks the same MPI library, so every rank lands here
        if "CUDA" not in str(e):
            raise
        skipped = str(e)
        break
    ours = engine_train(engine, batches)
    where = placement(engine)
    if rank == 0:
        ref, alts = references(cfg, batches, world, device)
        layouts = [b.layout for b in engine.sharded.buckets]
        rows.append(dict(stage=stage, dtype=dtype, accum=accum, clip=clip, optimizer=opt, world=world,
                         steps=args.steps, cuda_aware_mpi=args.cuda_aware, device=args.device,
                         **compare(ours, ref, alts, init), **where,
                         bytes_sent=engine.stats.bytes_sent, numel=sum(lay.numel for lay in layouts),
                         padded=sum(lay.padded_numel for lay in layouts), buckets=len(layouts)))
    engine.close()
if rank == 0:
    write_json(args.out, {"skipped": skipped} if skipped else rows)
