"""The independent reference of reproducible=True: the plain single-process PyTorch loop.

Per step, each of the G micro-batches in global index order: torch's generator seeded as the README
says (the first 8 bytes of SHA-256("zerompi/{seed}/{step}/{index}"), little-endian, shifted right by
one), forward, ``(loss / G).backward()``, its gradient added to the step's sum; then the fp32 masters take
a for-loop ``torch.optim.AdamW`` step and the compute model (bf16 or fp32) is cast from them. As the engine
does, the micro-batches' gradients are summed in the compute dtype (bf16 rounds after every add) and
widened to fp32 for the update. No zerompi
code runs here. Clipping is done two ways: ``"exact"`` scales by max_norm / (norm + 1e-6) with the norm
summed exactly (math.fsum of the fp64 squares), ``"torch"`` calls torch.nn.utils' own clipping
(its fp32 norm); ``nudge`` multiplies torch's norm by (1 + nudge) first, to see what one rounding of the
clip coefficient moves.
"""
from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
import repro_model as rm  # noqa: E402


def seed_of(seed: int, step: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"zerompi/{seed}/{step}/{index}".encode()).digest()[:8], "little") >> 1


def exact_norm(grads: list[torch.Tensor]) -> float:
    """sqrt of the exactly summed squares (each fp32 square is exact in fp64), rounded once by fsum."""
    return math.sqrt(math.fsum(v * v for g in grads for v in g.double().flatten().tolist()))


def train(dtype: torch.dtype, clip: str | None, nudge: float = 0.0) -> dict:
    """The trained state after rm.STEPS steps: {name: fp32 master, name/exp_avg, name/exp_avg_sq} and
    the exact gradient norm of every step (and torch's, where ``clip == "torch"``). One thread, as the
    engine's ``cpu_threads=1``: a matrix product's sums run in another order on more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(dtype, clip, nudge)
    finally:
        torch.set_num_threads(threads)


def _train(dtype: torch.dtype, clip: str | None, nudge: float) -> dict:
    net = rm.model(False)
    names = [n for n, _ in net.named_parameters()]
    masters = [p.detach().float().clone().requires_grad_(True) for p in net.parameters()]
    net.to(dtype)
    opt = torch.optim.AdamW(masters, lr=rm.LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=rm.WEIGHT_DECAY,
                            foreach=False, fused=False)
    norms, torch_norms = [], []
    for step in range(rm.STEPS):
        total = [torch.zeros_like(m, dtype=dtype) for m in masters]
        for index in range(rm.G):
            torch.manual_seed(seed_of(rm.SEED, step, index))
            x, y = rm.batch(step, index)
            net.zero_grad(set_to_none=True)
            (rm.loss_of(net(x.to(dtype)), y) * (1.0 / rm.G)).backward()
            for t, p in zip(total, net.parameters()):
                t.add_(p.grad)
        total = [t.float() for t in total]
        norms.append(exact_norm(total))
        for m, t in zip(masters, total):
            m.grad = t
        if clip == "exact":
            coef = rm.CLIP / (norms[-1] + 1e-6)
            if coef < 1.0:
                for t in total:
                    t.mul_(coef)
        elif clip == "torch":
            norm = torch.nn.utils.get_total_norm(total, foreach=False)
            torch_norms.append(float(norm))
            torch.nn.utils.clip_grads_with_norm_(masters, rm.CLIP, norm * (1.0 + nudge), foreach=False)
        opt.step()
        with torch.no_grad():
            for p, m in zip(net.parameters(), masters):
                p.copy_(m)
    state = {}
    for n, m in zip(names, masters):
        state[n] = m.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{n}/{key}"] = opt.state[m][key].clone()
    return dict(state=state, norms=norms, torch_norms=torch_norms)
