"""Checkpoint across devices: save from a GPU job, load in a CPU job (at any world size).

--mode save:   on --device (the GPU), train --before steps, save, train --after more;
               rank 0 writes the parameters at the save point (saved/) and at the end (final/).
--mode resume: on --device (the CPU), a model with other initial values loads the
               checkpoint (saved/), trains the same --after steps (final/), then loads
               again and trains them in other row orders (flip/, roll/): the order noise
               that tests/mpi/tolerance.check_resume bounds the continuation by.
The batches, orders and snapshots are tests/mpi/workers/ckpt.py's, so the global batch is
the same at every world size. Rank 0 writes OUT (.npz, no pickle).
"""
import numpy as np
from mpi4py import MPI

import zerompi
from gpu_common import parser, setup  # first: puts tests/mpi/workers on sys.path
from ckpt import ORDERS, snapshot, train
from common import tiny_gpt

p = parser(__doc__, steps=False)
p.add_argument("--mode", choices=("save", "resume"), required=True)
p.add_argument("--root", required=True)
p.add_argument("--stage", type=int, default=3)
p.add_argument("--dtype", default="fp32")
p.add_argument("--optimizer", choices=("adamw", "sgd"), default="sgd")
p.add_argument("--before", type=int, default=3)
p.add_argument("--after", type=int, default=3)
args = p.parse_args()
setup(args.device)
OPT = {"adamw": dict(optimizer="adamw", lr=1e-2, weight_decay=0.1), "sgd": dict(optimizer="sgd", lr=0.2, momentum=0.9)}
cfg = zerompi.ZeroConfig(stage=args.stage, dtype=args.dtype, bucket_mb=0.004, device=args.device,
                         cuda_aware_mpi="off", **OPT[args.optimizer])
out = {}
if args.mode == "save":
    engine = zerompi.initialize(tiny_gpt(1), cfg)
    train(engine, 0, args.before)
    engine.save_checkpoint(args.root, client_state={"next_step": args.before})
    out.update({f"saved/{k}": v for k, v in snapshot(engine).items()})
    train(engine, args.before, args.after)
else:
    engine = zerompi.initialize(tiny_gpt(7), cfg)
    state = engine.load_checkpoint(args.root)
    out.update({f"saved/{k}": v for k, v in snapshot(engine).items()})
    train(engine, state["next_step"], args.after)
    for order in ORDERS:
        again = zerompi.initialize(tiny_gpt(7), cfg)
        again.load_checkpoint(args.root)
        train(again, state["next_step"], args.after, order)
        out.update({f"{order}/{k}": v for k, v in snapshot(again).items()})
        again.close()
out.update({f"final/{k}": v for k, v in snapshot(engine).items()})
engine.close()
if MPI.COMM_WORLD.Get_rank() == 0:
    np.savez(args.out, **out)
