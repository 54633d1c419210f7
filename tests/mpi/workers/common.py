"""Shared pieces of the MPI test workers: models, data, the single-process reference, metrics.

The reference is plain PyTorch on one process: the whole global batch (every
rank's micro-batch, concatenated) goes through one model, ``torch.optim``
updates fp32 master weights, and (for bf16/fp16) the compute model is a
16-bit copy refreshed from the masters after every step. That is what ZeRO
at any stage and world size must reproduce.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import zerompi
from zerompi.models.gpt import GPT, GPTConfig
from zerompi.optim.optimizer import optimizer_kwargs

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
                    param_groups=None, zero_missing_grads: bool = True, order: "Order | None" = None,
                    lr_scheduler=None, lrs: list | None = None) -> Run:
    """Single-process training on the global batch with fp32 masters.

    ``lr_scheduler(opt)`` builds a scheduler stepped after every optimizer step; ``lrs``
    collects each step's learning rates (of every param group).

    ``order`` gives the same arithmetic in another summation order (see Order).
    How far that moves the result is the order noise the parity bounds are
    multiples of (see ``compare`` and tests/mpi/tolerance.py).
    """
    order = order or Order()
    master = copy.deepcopy(model)
    work = master if cfg.dtype == "fp32" else copy.deepcopy(model).to(DTYPES[cfg.dtype])
    pairs = [(m, w) for m, w in zip(master.parameters(), work.parameters()) if m.requires_grad]
    groups = param_groups(master) if param_groups else [{"params": [m for m, _ in pairs]}]
    opt = cfg.optimizer_class()(groups, **optimizer_kwargs(cfg.optimization, "cpu"))
    sched = lr_scheduler(opt) if lr_scheduler is not None else None
    # fp16: the engine's initial dynamic loss scale (it cannot change within a short run)
    scale = float(2 ** cfg.initial_scale_power) if cfg.dtype == "fp16" else 1.0
    parts = cfg.grad_accum_steps * order.chunks
    losses = []
    for micro_batches in batches:
        total = 0.0
        for batch in micro_batches:
            for part in order.parts(batch):
                loss = loss_fn(work, part)
                (loss * (scale if order.mean_last else scale / parts)).backward()
                total += float(loss.detach()) / parts
        losses.append(total)
        for m, w in pairs:
            # Unused parameters count as zero gradients, as in DDP and ZeRO.
            g = w.grad if w.grad is not None else (torch.zeros_like(w) if zero_missing_grads else None)
            m.grad = None if g is None else g.float() / scale
            if order.mean_last and m.grad is not None:
                m.grad.div_(parts)
        if cfg.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_([m for m, _ in pairs], cfg.clip_grad_norm)
        if lrs is not None:
            lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        work.zero_grad(set_to_none=True)
        if work is not master:
            with torch.no_grad():
                for m, w in pairs:
                    w.copy_(m)
    return Run({n: p.detach().float().clone() for n, p in master.named_parameters()}, losses)


def split_batch(batch, chunks: int) -> list[tuple]:
    """``batch`` (tensors sharing their first dimension) cut into ``chunks`` equal parts."""
    if chunks == 1:
        return [batch]
    rows = batch[0].shape[0]
    if rows % chunks:
        raise ValueError(f"{rows} rows do not split into {chunks} equal chunks")
    return [tuple(t[i * rows // chunks:(i + 1) * rows // chunks] for t in batch) for i in range(chunks)]


@dataclass(frozen=True)
class Order:
    """A summation order of the global batch: ``chunks`` equal parts whose gradients autograd
    sums last part first (1: the whole batch at once), with the rows reversed if ``flip``;
    each part's loss is scaled by 1/parts before its backward, or with ``mean_last`` the parts'
    gradients are summed as they are and the sum divided by the part count."""

    chunks: int = 1
    flip: bool = False
    mean_last: bool = False

    def parts(self, batch) -> list[tuple]:
        if self.flip:
            batch = tuple(t.flip(0) for t in batch)
        return split_batch(batch, self.chunks)[::-1]


def orders(world: int) -> list[Order]:
    """The reorderings whose spread is the order noise: one chunk per rank (as the engine splits
    the batch; two on one rank), twice as many chunks, and the rows reversed. Where the chunk
    count is not a power of two, also one chunk per rank with the mean taken last, as the
    engine takes it (sum the ranks' gradients, then divide): a division by a power of two is
    exact, so there that order would repeat the first bit for bit."""
    k = max(world, 2)
    out = [Order(k), Order(2 * k), Order(1, flip=True)]
    if k & (k - 1):
        out.append(Order(k, mean_last=True))
    return out


def reference_orders(make, cfg, batches, world: int, **kwargs) -> list[Run]:
    """``reference_train`` of a fresh ``make()`` once per reordering of ``orders(world)``."""
    return [reference_train(make(), cfg, batches, order=o, **kwargs) for o in orders(world)]


def references(comm, make, cfg, batches, lrs: list | None = None, **kwargs) -> tuple[Run | None, list[Run]]:
    """Collective over ``comm``: the reference (``reference_train`` of a fresh ``make()``) and its
    reorderings (``orders`` of the communicator's size), run i trained by rank i mod size, all
    gathered on rank 0: (reference, reorderings) there, (None, []) elsewhere. The same runs as
    rank 0 training all of them, in a fraction of the time: the other ranks would only wait.
    ``lrs`` collects the reference's learning rates; every rank's torch RNG state is kept."""
    tasks = [None, *orders(comm.Get_size())]
    mine = {}
    with torch.random.fork_rng(devices=[]):
        for i, order in enumerate(tasks):
            if i % comm.Get_size() == comm.Get_rank():
                got: list = []
                run = reference_train(make(), cfg, batches, order=order, lrs=got if i == 0 else None, **kwargs)
                mine[i] = (run, got)
    parts = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None, []
    runs = {i: r for part in parts for i, r in part.items()}
    if lrs is not None:
        lrs.extend(runs[0][1])
    return runs[0][0], [runs[i][0] for i in range(1, len(tasks))]


def compare(ours: Run, ref: Run, alts: list[Run], init: dict | None = None) -> dict:
    """What the parity tests judge: per-tensor error of ``ours`` against ``ref``, and the
    order noise: the largest distance of a reordered reference (``alts``) from ``ref``."""
    noise = [rel_per_tensor(a.params, ref.params) for a in alts]
    worst_alt = max(alts, key=lambda a: max(abs(x - y) for x, y in zip(a.losses, ref.losses)))
    out = dict(err=rel_per_tensor(ours.params, ref.params),
               noise={n: max(d[n] for d in noise) for n in ref.params},
               loss_ours=ours.losses, loss_ref=ref.losses, loss_alt=worst_alt.losses)
    out["max_rel"] = max(out["err"].values())
    if init is not None:
        out["rel_update"] = rel_to_update(ours.params, ref.params, init)
        out["rel_update_noise"] = max(rel_to_update(a.params, ref.params, init) for a in alts)
    return out


def zero_train(model: nn.Module, cfg: zerompi.ZeroConfig, batches, loss_fn=gpt_loss,
               param_groups=None, comm=None, lr_scheduler=None, lrs: list | None = None):
    """The same training through the engine; returns (Run, engine)."""
    engine = zerompi.initialize(model, cfg, comm=comm, lr_scheduler=lr_scheduler,
                                param_groups=param_groups(model) if param_groups else None)
    return engine_train(engine, batches, loss_fn, lrs), engine


def engine_train(engine, batches, loss_fn=gpt_loss, lrs: list | None = None) -> Run:
    """``batches[step]``'s global micro-batches through ``engine``, each rank on its part
    (``lrs`` collects the learning rates each step used)."""
    losses = []
    for micro_batches in batches:
        if lrs is not None:
            lrs.append(engine.get_lr())
        total = 0.0
        for batch in micro_batches:
            loss = loss_fn(engine, local_part(batch, engine.rank))
            engine.backward(loss)
            total += float(loss.detach()) / len(micro_batches)
            engine.step()
        losses.append(engine.all_reduce_mean(total))
    return Run(engine.full_state_dict(), losses)


def digest(run: Run) -> str:
    """SHA-256 of a run's final parameters (by name) and losses: equal only if bitwise equal."""
    h = hashlib.sha256()
    for name in sorted(run.params):
        h.update(name.encode())
        h.update(run.params[name].detach().cpu().contiguous().numpy().tobytes())
    h.update(json.dumps([float(x) for x in run.losses]).encode())
    return h.hexdigest()


def rel_per_tensor(ours: dict, ref: dict) -> dict[str, float]:
    """max|ours - ref| / max|ref| for each tensor (per-tensor scale, robust to tiny entries)."""
    return {name: float((ours[name] - r).abs().max()) / max(float(r.abs().max()), 1e-12)
            for name, r in ref.items()}


def max_rel_diff(ours: dict, ref: dict) -> float:
    """max over tensors of max|ours - ref| / max|ref|."""
    return max(rel_per_tensor(ours, ref).values())


def rel_to_update(ours: dict, ref: dict, init: dict) -> float:
    """||ours - ref|| / ||ref - init||: the disagreement as a fraction of the training update."""
    num = sum(float((ours[n] - ref[n]).double().pow(2).sum()) for n in ref)
    den = sum(float((ref[n] - init[n]).double().pow(2).sum()) for n in ref)
    return (num / max(den, 1e-30)) ** 0.5


def initial_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


FAULT_LINE = "the fault at"  # launcher.py's fault_at looks for it


def say_fault() -> None:
    """Print when this rank misbehaves on purpose (launcher.py's ``fault_at`` reads it): a test's bound on
    the job's end starts there, not at the launch."""
    print(f"{FAULT_LINE} {time.time()}", file=sys.stderr, flush=True)


def write_json(path: str, obj) -> None:
    """Write ``obj`` whole or not at all (a job killed while writing leaves no half file for a test to read)."""
    part = f"{path}.part-{os.getpid()}"
    with open(part, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(part, path)


def slow_capture(engine, seconds: float) -> None:
    """Delay each bucket a background save takes (the test's clock, not the engine's)."""
    frozen = engine.optimizer.fenced_state

    @contextmanager
    def slow(index):
        time.sleep(seconds)
        with frozen(index) as held:
            yield held
    engine.optimizer.fenced_state = slow


def state_items(engine):
    """(label, data) of the parameters, the fp32 masters and the optimizer state, gathered whole over the
    engine's group and cut per parameter (so shard padding, which moves with the world size, is left
    out); data is a float array, or the text of a scalar (Adam's step: the same on every rank)."""
    for name, t in engine.full_state_dict().items():
        yield name, t.float().contiguous().numpy()
    for i, bucket in enumerate(engine.sharded.buckets):
        with engine.optimizer.shard_state(i) as st:
            tensors = {"master": st.master, **{k: v for k, v in st.state.items() if isinstance(v, torch.Tensor)}}
            for key, t in sorted(tensors.items()):
                if t.numel() != st.master.numel():
                    yield key, f"{key}={t.item()!r}"
                    continue
                full = np.concatenate(engine.group.allgather_object(t.detach().float().cpu().numpy()))  # rank order
                for slot in bucket.layout.slots:
                    yield f"{slot.fqn}/{key}", full[slot.offset:slot.offset + slot.numel]


def state_digest(engine, extra: bytes = b"") -> str:
    """SHA-256 of :func:`state_items`, then ``extra``: the same at any world size when the training is."""
    h = hashlib.sha256()
    for label, data in state_items(engine):
        if isinstance(data, str):
            h.update(data.encode())
            continue
        h.update(label.encode())
        h.update(data.tobytes())
    h.update(extra)
    return h.hexdigest()

