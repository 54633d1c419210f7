"""Small engines the one-process checkpoint tests share."""
from __future__ import annotations

import torch
from torch import nn

import zerompi


def small_stage3_engine() -> zerompi.Engine:
    """A stage-3 engine of a tiny MLP on one rank (MPI_COMM_WORLD of a plain process), per-rank files."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    cfg = zerompi.ZeroConfig(stage=3, optimizer="adamw", lr=1e-2, bucket_mb=1e-4, cpu_threads=1, device="cpu",
                             checkpoint_layout="per_rank", abort_on_exception=False)
    return zerompi.initialize(model, cfg)
