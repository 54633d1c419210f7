"""Shared pieces of the MPI test workers: models, data, the single-process reference, metrics.

The reference is plain PyTorch on one process: the whole global batch (every
rank's micro-batch, concatenated) goes through one model, ``torch.optim``
updates fp32 master weights, and (for bf16/fp16) the compute model is a
16-bit copy refreshed from the masters after every step. That is what ZeRO
at any stage and world size must reproduce.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import torch
from torch import nn

import zerompi
from zerompi.models.gpt import GPT, GPTConfig
from zerompi.optim import optimizer_kwargs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VOCAB, SEQ, MICRO = 32, 16, 4


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    # No biases: the key bias has a mathematically zero gradient (softmax is shift-invariant),
    # so its gradient is pure rounding noise that Adam would blow up to full-size steps.
    cfg = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, bias=False)
    return GPT(GPTConfig(**{**cfg, **overrides}))


def gpt_loss(model, batch):
    x, y = batch
    return model(x, y)[1]


def token_batches(seed: int, world: int, steps: int, accum: int) -> list[list[tuple]]:
    """``[step][micro] -> (x, y)`` global micro-batches of ``world * MICRO`` sequences."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            data = torch.randint(0, VOCAB, (world * MICRO, SEQ + 1), generator=g)
            micro.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
        out.append(micro)
    return out


def local_part(batch, rank: int, rows: int = MICRO):
    return tuple(t[rank * rows:(rank + 1) * rows] for t in batch)


@dataclass
class Run:
    params: dict[str, torch.Tensor]  # fp32, full
    losses: list[float]              # per step, mean over the global batch


def reference_train(model: nn.Module, cfg: zerompi.ZeroConfig, batches, loss_fn=gpt_loss,
                    param_groups=None, zero_missing_grads: bool = True) -> Run:
    """Single-process training on the global batch with fp32 masters."""
    master = copy.deepcopy(model)
    work = master if cfg.dtype == "fp32" else copy.deepcopy(model).to(DTYPES[cfg.dtype])
    pairs = [(m, w) for m, w in zip(master.parameters(), work.parameters()) if m.requires_grad]
    groups = param_groups(master) if param_groups else [{"params": [m for m, _ in pairs]}]
    opt = cfg.optimizer_class()(groups, **optimizer_kwargs(cfg))
    # fp16: the engine's initial dynamic loss scale (it cannot change within a short run)
    scale = float(2 ** cfg.initial_scale_power) if cfg.dtype == "fp16" else 1.0
    losses = []
    for micro_batches in batches:
        total = 0.0
        for batch in micro_batches:
            loss = loss_fn(work, batch)
            (loss * (scale / cfg.grad_accum_steps)).backward()
            total += float(loss) / cfg.grad_accum_steps
        losses.append(total)
        for m, w in pairs:
            # Unused parameters count as zero gradients, as in DDP and ZeRO.
            g = w.grad if w.grad is not None else (torch.zeros_like(w) if zero_missing_grads else None)
            m.grad = None if g is None else g.float() / scale
        if cfg.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_([m for m, _ in pairs], cfg.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        work.zero_grad(set_to_none=True)
        if work is not master:
            with torch.no_grad():
                for m, w in pairs:
                    w.copy_(m)
    return Run({n: p.detach().float().clone() for n, p in master.named_parameters()}, losses)


def zero_train(model: nn.Module, cfg: zerompi.ZeroConfig, batches, loss_fn=gpt_loss,
               param_groups=None, comm=None):
    """The same training through the engine; returns (Run, engine)."""
    engine = zerompi.initialize(model, cfg, comm=comm,
                                param_groups=param_groups(model) if param_groups else None)
    losses = []
    for micro_batches in batches:
        total = 0.0
        for batch in micro_batches:
            loss = loss_fn(engine, local_part(batch, engine.rank))
            engine.backward(loss)
            total += float(loss) / cfg.grad_accum_steps
            engine.step()
        losses.append(engine.all_reduce_mean(total))
    return Run(engine.full_state_dict(), losses), engine


def max_rel_diff(ours: dict, ref: dict) -> float:
    """max over tensors of max|ours - ref| / max|ref| (per-tensor scale, robust to tiny entries)."""
    worst = 0.0
    for name, r in ref.items():
        scale = max(float(r.abs().max()), 1e-12)
        worst = max(worst, float((ours[name] - r).abs().max()) / scale)
    return worst


def rel_to_update(ours: dict, ref: dict, init: dict) -> float:
    """||ours - ref|| / ||ref - init||: the disagreement as a fraction of the training update."""
    num = sum(float((ours[n] - ref[n]).double().pow(2).sum()) for n in ref)
    den = sum(float((ref[n] - init[n]).double().pow(2).sum()) for n in ref)
    return (num / max(den, 1e-30)) ** 0.5


def initial_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
