"""DeepSpeed ZeRO-1/2/3 on CPU with gloo: one benchmark row (see rowlib).

Needs the peers venv (benchmarks/setup_peers.sh): DeepSpeed is never a zerompi
dependency. ``--variant`` is the ZeRO stage; fp32, a plain torch.optim.AdamW,
no gradient clipping (as in every row), everything else DeepSpeed's default
(bucket sizes, no overlap; at stage 3 the default reuse distance and live-parameter
limits keep this model's gathered parameters from forward to backward).
"""
from __future__ import annotations

import logging
import os

import commcount
import rowlib
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def ds_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": int(args.variant)},
        "zero_allow_untested_optimizer": True,  # a plain torch.optim.AdamW, not DeepSpeed's
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 by default; no row clips
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build(model, args, comm) -> rowlib.Trainer:
    commcount.install()  # before DeepSpeed's comm layer takes references to the collectives
    rowlib.init_torch_distributed(comm)
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=rowlib.BETAS, eps=rowlib.EPS,
                            weight_decay=args.weight_decay)
    config = ds_config(args)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    return rowlib.Trainer(step=rowlib.engine_step(engine), bytes_sent=commcount.bytes_sent,
                          info=dict(deepspeed=deepspeed.__version__, config=config))


if __name__ == "__main__":
    rowlib.main(build, variants=("1", "2", "3"))
