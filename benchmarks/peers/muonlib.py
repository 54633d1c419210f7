"""What the Muon rows of bench_muon.py share: the split, the hyperparameters, state bytes per rank.

The split is the same in every row: Muon on the hidden matrices (each block's attention and MLP
weights, ``transformer.h.*.{attn,mlp}.c_*.weight``), AdamW on the rest (token and position
embeddings, the tied head, biases, LayerNorms). Muon: lr 0.02, momentum 0.95 with Nesterov,
5 Newton-Schulz steps in bf16, weight decay 0.01, the update scaled by sqrt(max(1, rows/cols));
AdamW: the rows' lr 3e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01 (rowlib).

Rows run like any rowlib row, with one addition: after the last timed step every rank reports its
optimizer state (``per_rank`` in the trainer's info, a callable run on every rank, its results
gathered), since state lives where it is owned and rank 0 cannot see the others'.
"""
from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import rowlib
import torch
from rowlib import MPI

MUON_LR = 0.02
MOMENTUM = 0.95
MUON_STATE_KEYS = ("momentum_buffer",)  # torch.optim.Muon's and DeepSpeed's Muon's state; AdamW's is exp_avg(_sq)


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """A block's attention or MLP weight: Muon's half of the split."""
    return p.dim() == 2 and ".h." in f".{name}" and (".attn." in name or ".mlp." in name)


def split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's parameters, AdamW's parameters), each in the model's order."""
    muon, rest = [], []
    for name, p in model.named_parameters():
        (muon if is_hidden_matrix(name, p) else rest).append(p)
    return muon, rest


def state_bytes(state: dict) -> dict[str, int]:
    """Bytes of optimizer state tensors (scalars such as ``step`` left out), Muon's and the rest's."""
    out = {"muon": 0, "adamw": 0}
    for per_param in state.values():
        for key, v in per_param.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out["muon" if key in MUON_STATE_KEYS else "adamw"] += v.numel() * v.element_size()
    return out


def balance(per_rank: list[dict], key: str) -> float | None:
    """The largest rank's ``key`` over the mean of the ranks' (1.0: even); None where there is none."""
    vals = [r[key] for r in per_rank]
    mean = sum(vals) / len(vals)
    return max(vals) / mean if mean else None


def main(build: Callable[..., rowlib.Trainer], variants: tuple[str, ...]) -> None:
    """rowlib.main, and every rank's ``info["per_rank"]()`` after the last step, gathered into the row."""
    args = rowlib.parse_args(variants)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    comm = MPI.COMM_WORLD
    t0 = time.perf_counter()
    corpus = rowlib.ByteCorpus()
    model = rowlib.build_model(args.size, args.seed)
    params = model.num_params()
    muon_params = sum(p.numel() for p in split(model)[0])
    trainer = build(model, args, comm)
    per_rank_fn = trainer.info.pop("per_rank")
    torch.set_num_threads(1)  # a framework may have changed it; every row gets one thread per rank
    comm.Barrier()
    setup_s = time.perf_counter() - t0
    gc.collect()
    rss_setup = rowlib.rss_bytes()
    mine = rowlib._timed_loop(trainer, corpus, args, comm)
    mine["rss_setup"] = rss_setup
    ranks = comm.gather(mine, root=0)
    per_rank = comm.gather(per_rank_fn(), root=0)
    if comm.Get_rank() == 0:
        result = rowlib._summarise(ranks, args, params, trainer, setup_s)
        result.update(muon_params=muon_params, per_rank=per_rank,
                      opt_state_bytes_per_rank=[r["opt_state_bytes"] for r in per_rank],
                      muon_balance=balance(per_rank, "muon_state_bytes"))
        Path(args.out).write_text(json.dumps(result))
    comm.Barrier()
