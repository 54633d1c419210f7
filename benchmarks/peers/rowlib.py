"""What every benchmark row shares: model, data, rendezvous, the timed loop, the result.

A row is one framework at one setting, run as its own MPI job::

    mpiexec -n 2 python -m mpi4py benchmarks/peers/run_ddp.py --size 20M --variant ddp --out r.json

Each runner builds a :class:`Trainer` from the model and hands it to :func:`main`,
which takes the same steps on the same data for every row: the GPT is built from
the same seed on every rank, rank r's micro-batch at step s is drawn from a
generator seeded by (seed, s, r), and every rank uses one torch thread. Rank 0
writes one JSON object with the row's measurements to ``--out``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# The package measured: ZEROMPI_BENCH_TREE's (ab_commits.py times another commit's tree), else this checkout's,
# installed or not; every row records which one it imported.
sys.path.insert(0, os.environ.get("ZEROMPI_BENCH_TREE") or str(Path(__file__).resolve().parents[2]))
from mpi4py import MPI  # noqa: E402

import calltrace  # noqa: E402
from zerompi.models.corpus import ByteCorpus  # noqa: E402
from zerompi.models.gpt import GPT, GPTConfig  # noqa: E402

MODEL_SIZES = {
    "2M": dict(n_layer=2, n_embd=256, n_head=4),  # bench_cluster.py: links, not compute, set its step time
    "20M": dict(n_layer=6, n_embd=512, n_head=8),
    "120M": dict(n_layer=17, n_embd=768, n_head=12),
}
BLOCK = 256            # sequence length = the model's block size
BETAS = (0.9, 0.999)   # AdamW coefficients, the same for every framework
EPS = 1e-8


@dataclass
class Trainer:
    """One framework's training step and its communication counters."""

    step: Callable[[torch.Tensor, torch.Tensor], float]  # one optimizer step; returns this rank's loss
    bytes_sent: Callable[[], dict[str, int]]             # cumulative bytes this rank sent, per kind
    implicit_bytes_per_step: int = 0    # traffic no counter sees (DDP's C++ all-reduce), from its algorithm
    info: dict = field(default_factory=dict)  # recorded with the row; callables are called after the last step


def torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[..., float]:
    """One plain PyTorch training step (forward, backward, update), for the torch.distributed rows."""
    def step(x, y) -> float:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def engine_step(engine) -> Callable[..., float]:
    """One training step through an engine that owns backward and the update (zerompi's, DeepSpeed's)."""
    def step(x, y) -> float:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


def parse_args(variants: tuple[str, ...]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one benchmark row (run under mpiexec)")
    p.add_argument("--size", choices=sorted(MODEL_SIZES), default="20M")
    p.add_argument("--variant", choices=variants, required=True)
    add_training_args(p, steps=10)
    p.add_argument("--out", required=True, help="JSON result file (written by rank 0)")
    p.add_argument("--trace", action="store_true",
                   help="record the collectives of the timed steps (calltrace.py; bench_transport.py)")
    return p.parse_args()


def add_training_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The training settings every benchmark row shares (same model, data and optimizer)."""
    p.add_argument("--steps", type=int, default=steps, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=1337)


def build_model(size: str, seed: int) -> GPT:
    torch.manual_seed(seed)  # the same initial weights on every rank and in every row
    return GPT(GPTConfig(vocab_size=256, block_size=BLOCK, dropout=0.0, **MODEL_SIZES[size]))


def batch(corpus: ByteCorpus, args: argparse.Namespace, step: int, rank: int):
    """Rank ``rank``'s micro-batch of step ``step``, independent of anything drawn before."""
    state = np.random.SeedSequence([args.seed, step, 0, rank]).generate_state(1, np.uint64)[0]
    return corpus.get_batch("train", args.micro_batch, BLOCK, torch.Generator().manual_seed(int(state)))


def init_torch_distributed(comm: MPI.Comm) -> None:
    """gloo process group; rank and size from MPI, the address and port from the driver."""
    import torch.distributed as dist
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    env = dict(RANK=comm.Get_rank(), WORLD_SIZE=comm.Get_size(), LOCAL_RANK=local.Get_rank(),
               LOCAL_WORLD_SIZE=local.Get_size())
    local.Free()
    os.environ.update({k: str(v) for k, v in env.items()})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def rss_bytes() -> int:
    """Resident set size now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _timed_loop(trainer: Trainer, corpus: ByteCorpus, args, comm: MPI.Comm) -> dict:
    rank = comm.Get_rank()
    times, losses = [], []
    sent_before = {}
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sent_before = trainer.bytes_sent()
            if getattr(args, "trace", False):
                calltrace.start()
        x, y = batch(corpus, args, step, rank)
        comm.Barrier()  # every rank starts the step together: the slowest rank's time is the step's
        t0 = time.perf_counter()
        loss = trainer.step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    sent_after = trainer.bytes_sent()
    calls = calltrace.stop()
    delta = {k: v - sent_before.get(k, 0) for k, v in sent_after.items()}
    gc.collect()
    return dict(times=times[args.warmup:], losses=losses,
                bytes_per_step={k: v / args.steps for k, v in delta.items() if v},
                rss_steady=rss_bytes(), rss_peak=peak_rss_bytes(), threads=torch.get_num_threads(),
                **(dict(trace=calls) if getattr(args, "trace", False) else {}))


def _summarise(ranks: list[dict], args, params: int, trainer: Trainer, setup_s: float) -> dict:
    """Rank 0: one row's numbers from every rank's measurements."""
    n = len(ranks)
    slowest = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
    losses = [sum(r["losses"][i] for r in ranks) / n for i in range(len(ranks[0]["losses"]))]
    kinds = sorted({k for r in ranks for k in r["bytes_per_step"]})
    per_kind = {k: sum(r["bytes_per_step"].get(k, 0) for r in ranks) / n for k in kinds}
    return dict(
        world_size=n, params=params, steps=args.steps, warmup=args.warmup, setup_s=setup_s,
        step_s_median=float(np.median(slowest)), step_s_min=min(slowest), step_s_max=max(slowest),
        step_s_all=slowest, loss_first=losses[0], loss_final=losses[-1], losses=losses,
        rss_peak_max=max(r["rss_peak"] for r in ranks), rss_steady_max=max(r["rss_steady"] for r in ranks),
        rss_setup_max=max(r["rss_setup"] for r in ranks),
        rss_peak_per_rank=[r["rss_peak"] for r in ranks], rss_steady_per_rank=[r["rss_steady"] for r in ranks],
        bytes_per_step_kinds=per_kind,
        bytes_per_step=sum(per_kind.values()) + trainer.implicit_bytes_per_step,
        implicit_bytes_per_step=trainer.implicit_bytes_per_step,
        threads=sorted({r["threads"] for r in ranks}),
        info={k: v() if callable(v) else v for k, v in trainer.info.items()},
        package=str(Path(sys.modules["zerompi"].__file__).resolve().parents[1]) if "zerompi" in sys.modules else None,
        **({"trace": ranks[0]["trace"]} if "trace" in ranks[0] else {}))


def main(build: Callable[[torch.nn.Module, argparse.Namespace, MPI.Comm], Trainer],
         variants: tuple[str, ...]) -> None:
    """Run one row: build the model and the framework's trainer, time the steps, write the result."""
    args = parse_args(variants)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    comm = MPI.COMM_WORLD
    t0 = time.perf_counter()
    corpus = ByteCorpus()
    model = build_model(args.size, args.seed)
    params = model.num_params()
    if args.trace:
        calltrace.install_zerompi()
    trainer = build(model, args, comm)
    torch.set_num_threads(1)  # a framework may have changed it; every row gets one thread per rank
    comm.Barrier()
    setup_s = time.perf_counter() - t0
    gc.collect()
    rss_setup = rss_bytes()
    mine = _timed_loop(trainer, corpus, args, comm)
    mine["rss_setup"] = rss_setup
    ranks = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        result = _summarise(ranks, args, params, trainer, setup_s)
        Path(args.out).write_text(json.dumps(result))
    comm.Barrier()
