"""zerompi at stage 2 or 3 with AdamW on every parameter, or Muon + AdamW: one row of bench_muon.py.

``--variant STAGE-adamw``: ``ZeroConfig(optimizer="adamw")`` over every parameter, as bench_peers'
zerompi rows. ``--variant STAGE-muon``: the same config, with the hidden matrices in a param group of
their own that runs ``torch.optim.Muon`` (muonlib.py has the split and the hyperparameters); that
group's buckets are owner-aligned, so each matrix's Muon step and momentum are on one rank.
"""
from __future__ import annotations

import muonlib
import rowlib
import torch


def build(model, args, comm) -> rowlib.Trainer:
    import zerompi
    stage, opt = args.variant.split("-")
    cfg = zerompi.ZeroConfig(stage=int(stage), optimizer="adamw", lr=args.lr, betas=rowlib.BETAS,
                             eps=rowlib.EPS, weight_decay=args.weight_decay, bucket_mb=args.bucket_mb,
                             cpu_threads=1, seed=args.seed)
    groups = None
    if opt == "muon":
        muon, rest = muonlib.split(model)
        groups = [{"params": muon, "optimizer": torch.optim.Muon, "lr": muonlib.MUON_LR,
                   "momentum": muonlib.MOMENTUM, "nesterov": True, "weight_decay": args.weight_decay},
                  {"params": rest}]
    engine = zerompi.initialize(model, cfg, comm=comm, param_groups=groups)

    def per_rank() -> dict:
        views = engine.optimizer.views.of
        return dict(opt_state_bytes=engine.optimizer.state_bytes(),
                    **{f"{k}_state_bytes": v for k, v in muonlib.state_bytes(engine.optimizer.state).items()},
                    muon_params_owned=sum(v.numel() for vs in views.values() for v, _, _ in vs),
                    model_state_bytes=engine.stats.model_state_bytes)

    info = dict(stage=cfg.stage, bucket_mb=cfg.bucket_mb, optimizer=opt, per_rank=per_rank,
                groups=engine.optimizer.group_names)
    return rowlib.Trainer(step=rowlib.engine_step(engine), bytes_sent=lambda: dict(engine.stats.bytes_sent),
                          info=info)


if __name__ == "__main__":
    muonlib.main(build, variants=("2-adamw", "2-muon", "3-adamw", "3-muon"))
