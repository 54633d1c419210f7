"""zerompi stages 0-3: one benchmark row (see rowlib).

``--variant`` is the stage, optionally with ``-overlap`` (overlap_grad_reduce, and at stage 3
prefetch_units=1) and ``-test`` or ``-thread`` (mpi_progress='test' or 'thread').
"""
from __future__ import annotations

import rowlib


def build(model, args, comm) -> rowlib.Trainer:
    import zerompi
    stage, *flags = args.variant.split("-")
    overlap = dict(overlap_grad_reduce=True, prefetch_units=1 if stage == "3" else 0) if "overlap" in flags else {}
    cfg = zerompi.ZeroConfig(stage=int(stage), optimizer="adamw", lr=args.lr, betas=rowlib.BETAS,
                             eps=rowlib.EPS, weight_decay=args.weight_decay, bucket_mb=args.bucket_mb,
                             cpu_threads=1, seed=args.seed, **overlap,
                             mpi_progress=next((f for f in flags if f in ("test", "thread")), "none"))
    engine = zerompi.initialize(model, cfg, comm=comm)

    info = dict(stage=cfg.stage, bucket_mb=cfg.bucket_mb,
                model_state_bytes=lambda: engine.stats.model_state_bytes)
    return rowlib.Trainer(step=rowlib.engine_step(engine), bytes_sent=lambda: dict(engine.stats.bytes_sent),
                          info=info)


if __name__ == "__main__":
    rowlib.main(build, variants=("0", "1", "2", "3", "2-overlap", "2-overlap-test", "2-overlap-thread",
                                     "3-overlap", "3-overlap-test", "3-overlap-thread"))
