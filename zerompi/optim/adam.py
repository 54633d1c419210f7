"""Adam and AdamW without bias correction (DeepSpeed's ``bias_correction: false``).

torch's Adam and AdamW always divide the moments by ``1 - beta**t``; DeepSpeed's kernels can leave
that out, and a config that does trains otherwise (the first steps are 1/(1-beta1) larger with
correction). This is that update, per element, as DeepSpeed's CPU and fused kernels compute it:

    p <- p * (1 - lr * wd)                        (decoupled, AdamW's; else g <- g + wd * p, Adam's L2)
    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g^2
    p <- p - lr * m / (sqrt(v) + eps)

The coefficients (``beta1``, ``1 - beta1``, ``beta2``, ``1 - beta2``, ``lr * wd``) are computed in fp32,
as DeepSpeed's kernel computes them: without the correction, which in torch's Adam cancels most of it,
``1 - beta2`` rounded from an fp32 ``beta2`` (1.3e-5 off 0.001 for 0.999) shows in every step.

It keeps torch's state names (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints hold it as they
hold Adam's, and declares itself element-wise (optim/kinds.py): flat shards step exactly as whole tensors.
"""
from __future__ import annotations

from typing import Any

import torch

PATH = "zerompi.optim.adam.UncorrectedAdam"
"""The dotted name configs give it by (``ZeroConfig(optimizer=PATH)``)."""


class UncorrectedAdam(torch.optim.Optimizer):
    """Adam(W) without bias correction; ``decoupled`` (the default) decays the weights as AdamW does."""

    elementwise = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = True):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"UncorrectedAdam: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}: "
                             "allowed: lr, eps, weight_decay >= 0 and each beta in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled=decoupled))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta1, beta2, eps, wd = _fp32(group["lr"], *group["betas"], group["eps"], group["weight_decay"])
            one_beta1, one_beta2, decay = _fp32(1 - beta1, 1 - beta2, 1 - lr * wd)
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                if wd != 0:
                    if group["decoupled"]:
                        p.mul_(decay)
                    else:
                        grad = grad.add(p, alpha=wd)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=one_beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=one_beta2)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
        return loss


def _fp32(*values: float) -> list[float]:
    """Each value rounded to fp32 (the kernel's arithmetic on its coefficients)."""
    return torch.tensor(values, dtype=torch.float32).tolist()
