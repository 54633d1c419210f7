"""DeepSpeed 0.19.8's Muon update, on a whole matrix: the Muon half of ``"optimizer": {"type": "Muon"}``.

DeepSpeed's arithmetic, step for step (``runtime/zero/muon/original_muon.py`` there):

* momentum ``m <- lerp(m, g, 1 - beta)`` (left alone when ``g`` is not finite), then the Nesterov
  blend ``u = lerp(g, m, beta)``;
* ``u`` orthogonalised by five quintic Newton-Schulz steps, coefficients (3.4445, -4.7750, 2.0315),
  after dividing by its Frobenius norm + 1e-7, on the wide orientation (a tall matrix is transposed
  and back); ``ns_method="gram"`` iterates on the Gram matrix with a restart before the third step
  (square matrices take the plain iteration), ``"standard"`` on the matrix itself;
* the iteration runs in fp16 (gram) or bf16 (standard) where the device has kernels for it, else
  fp32: DeepSpeed's accelerator asks the same question (on a CPU, fp16 needs mkldnn's fp16
  support; bf16 is always there), and the answer changes the result by far more than rounding;
* the result scaled by ``sqrt(rows / cols)`` when rows > cols; a 3-D tensor is a batch of matrices
  (DeepSpeed's 4-D path, for conv filters, fails in its final ``torch.where``, so 4-D is refused);
* ``p <- p * (1 - lr * weight_decay) - lr * u``.

Products are grouped as DeepSpeed groups them (``(c * A) @ A``): fp32 rounding then matches op for
op, so what differs from DeepSpeed is the gradient's summation order alone.
"""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["NS_METHODS", "Muon", "muon_update", "ns_dtype", "orthogonalise"]

A, B, C = 3.4445, -4.7750, 2.0315
EPS = 1e-7
STEPS = 5
RESTART = 2  # the Gram iteration rebuilds X and R from the product so far before this step
NS_METHODS = ("gram", "standard")


def _fp16_kernels(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 7
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _bf16_kernels(device: torch.device) -> bool:
    return torch.cuda.is_bf16_supported() if device.type == "cuda" else True


def ns_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype DeepSpeed runs ``method``'s iteration in on ``device``."""
    if method == "gram":
        return torch.float16 if _fp16_kernels(device) else torch.float32
    return torch.bfloat16 if _bf16_kernels(device) else torch.float32


def _plain_steps(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        gram = x @ x.mT
        x = A * x + (B * gram + (C * gram) @ gram) @ x
    return x


def _standard(g: torch.Tensor, steps: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype or ns_dtype("standard", g.device))
    x = x.mT if tall else x
    x = _plain_steps(x / (x.norm(dim=(-2, -1), keepdim=True) + EPS), steps)
    return x.mT if tall else x


def _gram(g: torch.Tensor, steps: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    tall = g.size(-2) > g.size(-1)
    # Normalised before the cast, in a dtype with fp32's range, as DeepSpeed does.
    x = g.to(torch.float32 if g.dtype == torch.float16 else g.dtype)
    x = x.mT if tall else x
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + EPS)).to(dtype or ns_dtype("gram", g.device))
    if x.size(-1) <= x.size(-2):  # square: no smaller Gram matrix to iterate on
        x = _plain_steps(x, steps)
        return x.mT if tall else x
    r, q = x @ x.mT, None
    for i in range(steps):
        if i == RESTART:
            x = q @ x
            r, q = x @ x.mT, None
        z = B * r + (C * r) @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(A)
        else:
            q = A * q + z @ q
        if i < steps - 1 and i + 1 != RESTART:
            rz = A * r + z @ r
            r = A * rz + z @ rz
    return x.mT @ q.mT if tall else q @ x


def orthogonalise(u: torch.Tensor, method: str = "gram", steps: int = STEPS) -> torch.Tensor:
    """Newton-Schulz on the last two dims of ``u`` (a batch over the others), in ``ns_dtype``."""
    return (_gram if method == "gram" else _standard)(u, steps)


def _aspect_scale(rows: int, cols: int) -> float:
    return math.sqrt(rows / cols) if rows > cols else 1.0


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float, method: str = "gram") -> torch.Tensor:
    """DeepSpeed's Muon direction for ``grad``; advances ``momentum`` in place (``grad`` is left as it is)."""
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
    u = orthogonalise(grad.lerp(momentum, beta), method)
    u *= _aspect_scale(grad.size(-2), grad.size(-1))
    u = u.to(grad.dtype)
    return torch.where(finite, u, grad)  # a non-finite gradient goes through, to be seen as one


class Muon(torch.optim.Optimizer):
    """DeepSpeed's Muon half as a torch optimizer over whole tensors (matrices, or 3-D batches of them).

    Not element-wise: zerompi steps it on each tensor's owner rank (optim/whole.py), so the update
    sees the whole matrix, as DeepSpeed's does at every ZeRO stage."""

    def __init__(self, params: Any, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_method: str = "gram"):
        if ns_method not in NS_METHODS:
            raise ValueError(f"ns_method={ns_method!r} is not one of {', '.join(NS_METHODS)}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "ns_method": ns_method})
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon orthogonalises matrices (or 3-D batches of them); a tensor of shape "
                                     f"{list(p.shape)} is not one (DeepSpeed 0.19.8 gives 1-D tensors to its Adam "
                                     "half, and its Muon fails on 4-D ones)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)  # DeepSpeed steps it too
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                u = muon_update(grad, state["momentum_buffer"], group["momentum"], group["ns_method"])
                p.mul_(1 - lr * decay)
                p.add_(u.reshape(p.shape), alpha=-lr)
        return loss
