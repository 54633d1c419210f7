"""DeepSpeed ZeRO-2/3 on CPU with AdamW, or with its own Muon: one row of bench_muon.py.

Needs DeepSpeed (benchmarks/setup_peers.sh). ``--variant STAGE-adamw``: a plain torch.optim.AdamW over
every parameter, as bench_peers' DeepSpeed rows. ``--variant STAGE-muon``: DeepSpeed's
``"optimizer": {"type": "Muon"}``, its parameters tagged ``use_muon`` by muonlib's split (DeepSpeed's
own tagging, by name, would also put the token and position embeddings under Muon: neither is
named "embed" here), with Muon's lr, momentum and weight decay and the auxiliary Adam's lr, betas,
eps and weight decay of every row. ``ns_method="standard"``: Newton-Schulz in bf16 on the CPU, as
torch.optim.Muon runs it (DeepSpeed's default "gram" runs in fp32 on a CPU without fp16 kernels).
At ZeRO-3 with Muon, ``reduce_scatter: false``, which DeepSpeed requires there. Fp32, no gradient
clipping, everything else DeepSpeed's defaults.
"""
from __future__ import annotations

import logging
import os

import commcount
import muonlib
import rowlib
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def ds_config(args, stage: int, opt: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 by default; no row clips
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if opt == "muon":
        config["optimizer"] = {"type": "Muon", "params": {
            "lr": args.lr, "muon_lr": muonlib.MUON_LR, "adam_lr": args.lr, "momentum": muonlib.MOMENTUM,
            "betas": list(rowlib.BETAS), "eps": rowlib.EPS, "weight_decay": args.weight_decay,
            "ns_method": "standard"}}
        if stage == 3:  # DeepSpeed's ZeRO-3 refuses Muon with its default reduce-scatter ("Muon and reduce
            config["zero_optimization"]["reduce_scatter"] = False  # scatter cannot be used together")
    else:
        config["zero_allow_untested_optimizer"] = True  # a plain torch.optim.AdamW, not DeepSpeed's
    return config


def tag_as_muonlib(deepspeed) -> None:
    """DeepSpeed tags ``use_muon`` inside ``initialize``; re-tag right after it by muonlib's split."""
    original = deepspeed.set_optimizer_flags

    def set_optimizer_flags(config_class, model):
        original(config_class, model)
        for name, p in model.named_parameters():
            p.use_muon = muonlib.is_hidden_matrix(name, p)
    deepspeed.set_optimizer_flags = set_optimizer_flags


def per_rank_of(engine):
    def per_rank() -> dict:
        zero = engine.optimizer
        by_kind = muonlib.state_bytes(zero.optimizer.state)
        staged = getattr(zero, "_muon_pending_momentum", {}) or {}
        return dict(opt_state_bytes=sum(by_kind.values()), **{f"{k}_state_bytes": v for k, v in by_kind.items()},
                    muon_staging_bytes=sum(s.numel() * s.element_size() for s, _ in staged.values()))
    return per_rank


def build(model, args, comm) -> rowlib.Trainer:
    commcount.install()  # before DeepSpeed's comm layer takes references to the collectives
    rowlib.init_torch_distributed(comm)
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    stage, opt = args.variant.split("-")
    config = ds_config(args, int(stage), opt)
    if opt == "muon":
        tag_as_muonlib(deepspeed)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        adamw = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=rowlib.BETAS, eps=rowlib.EPS,
                                  weight_decay=args.weight_decay)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw, config=config)

    info = dict(deepspeed=deepspeed.__version__, config=config, optimizer=opt, per_rank=per_rank_of(engine),
                basic_optimizer=type(engine.optimizer.optimizer).__name__,
                aux_optimizer=type(getattr(engine.optimizer.optimizer, "aux_optimizer", None)).__name__)
    return rowlib.Trainer(step=rowlib.engine_step(engine), bytes_sent=commcount.bytes_sent, info=info)


if __name__ == "__main__":
    muonlib.main(build, variants=("2-adamw", "2-muon", "3-adamw", "3-muon"))
