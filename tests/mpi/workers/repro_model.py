"""The model, data and settings of workers/reproducible.py, in plain torch: the worker trains them
with the engine, and tests/mpi/plain_loop.py with the plain single-process loop (no zerompi)."""
from __future__ import annotations

import torch
from torch import nn

G, STEPS = 6, 3                 # micro-batches per step, optimizer steps
LR, WEIGHT_DECAY, CLIP = 3e-2, 0.1, 0.05
SEED = 0                        # ZeroConfig.seed: the micro-batches' generator seeds derive from it


def model(frozen: bool | str) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 48), nn.LayerNorm(48), nn.GELU(), nn.Dropout(0.2), nn.Linear(48, 40),
                      nn.Tanh(), nn.Dropout(0.1), nn.Linear(40, 4))
    if frozen == "lora":  # peft's LoRA on the first and second Linear, with its own dropout; the base frozen
        import peft
        return peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["0", "4"]))
    if frozen:
        m[0].requires_grad_(False)
    return m


def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = out.float()
    return ((out - y.to(out.device)) ** 2).mean()
