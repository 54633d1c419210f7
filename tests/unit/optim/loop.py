"""The independent reference of the optimizer tests: the plain single-process PyTorch loop, and the engine's
loop over the same micro-batches. ``(loss / G).backward()`` over the G micro-batches of a step (in index
order, or in other orders for the order noise), then each torch optimizer's ``step()``."""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

G = 6  # micro-batches per step


class Template:
    """A model built once: thread ranks drawing from torch's one global generator at once would race."""

    def __init__(self, build: Callable[[], nn.Module]):
        torch.manual_seed(0)
        self.model = build()

    def __call__(self) -> nn.Module:
        return copy.deepcopy(self.model)


def batch(step: int, index: int, width: int = 6, out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(4, width, generator=g), torch.randn(4, out, generator=g)


def plain(net: nn.Module, opts: list[torch.optim.Optimizer], steps: int,
          chunks: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """``net`` trained by ``opts``; ``chunks``: another summation order (each chunk's micro-batches summed,
    then the chunks, as the engine's default mode sums each rank's, then the ranks'); None: index order."""
    device = next(net.parameters()).device  # the batches go where the model is (the GPU suite's runs)
    for step in range(steps):
        total = [torch.zeros_like(p) for p in net.parameters()]
        for chunk in chunks or [[i] for i in range(G)]:
            part = [torch.zeros_like(p) for p in net.parameters()]
            for index in chunk:
                x, y = (t.to(device) for t in batch(step, index))
                net.zero_grad(set_to_none=True)
                (F.mse_loss(net(x), y) * (1.0 / G)).backward()
                for t, p in zip(part, net.parameters()):
                    t.add_(p.grad)
            for t, q in zip(total, part):
                t.add_(q)
        for p, t in zip(net.parameters(), total):
            p.grad = t
        for o in opts:
            o.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def train(engine, steps: range) -> None:
    """The engine over the micro-batches it is dealt (reproducible=True, micro_batches=G)."""
    for step in steps:
        for index in engine.micro_batch_indices():
            x, y = (t.to(engine.device) for t in batch(step, index))
            engine.backward(F.mse_loss(engine(x), y))
        assert engine.step()
