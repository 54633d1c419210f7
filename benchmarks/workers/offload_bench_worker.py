"""Offload benchmark worker (run by ``bench_offload.py``): one job's measurements, as JSON from rank 0.

    mpiexec -n 2 python -m mpi4py benchmarks/workers/offload_bench_worker.py --modes none nvme --swap DIR --out OUT.json

Training (default): the GPT, data and AdamW of ``benchmarks/peers`` (rowlib) at stage 3 with ``offload_optimizer`` =
``offload_params`` = each of --modes. Steps are timed from a barrier; timers wrapped around zerompi's methods at run
time (its code is unchanged) split them, and every swapper read and write is traced. --parity: the MPI tests' tiny GPT,
3 steps per (dtype, optimizer_kwargs, mode), compared bitwise. --adam (1 rank): torch.optim.AdamW on flat fp32 buckets
with torch's CPU default, foreach=True and fused=True on 1 and 2 threads, in turns; then the results compared.
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks" / "peers")]  # run from a checkout, uninstalled
import rowlib  # noqa: E402  (the peers benchmark's model, data and settings)
from mpi4py import MPI  # noqa: E402

import zerompi  # noqa: E402
from zerompi.models.gpt import GPT, GPTConfig  # noqa: E402
from zerompi.offload.residency import NVMeResidency  # noqa: E402

COMM = MPI.COMM_WORLD


def make_config(mode: str, dtype: str, swap: str, args, **extra) -> zerompi.ZeroConfig:
    return zerompi.ZeroConfig(stage=3, dtype=dtype, optimizer="adamw", lr=args.lr, betas=rowlib.BETAS,
                              eps=rowlib.EPS, weight_decay=args.weight_decay, bucket_mb=args.bucket_mb,
                              cpu_threads=1, seed=args.seed, offload_optimizer=mode, offload_params=mode,
                              nvme_path=swap if mode == "nvme" else None, **extra)


def wrap(obj, name: str, acc: dict, key: str) -> None:
    """Replace ``obj.name`` (on the instance) by a copy that adds its wall time to ``acc[key]``."""
    fn = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0
    setattr(obj, name, timed)


def instrument(engine) -> dict:
    acc = defaultdict(float)
    for b, name in ((c, name) for c in engine.sharded.collectives for name in ("unshard", "publish")):
        wrap(b, name, acc, name)
    wrap(engine.optimizer.inner, "step", acc, "adam")
    store = engine.optimizer.store
    if isinstance(store, NVMeResidency):  # waiting for reads (_ready) and for writes (_settle)
        for name in ("_ready", "_settle"):
            wrap(store, name, acc, "swap_wait")
    return acc


def trace_transfers(swapper, events: list) -> None:
    """Record (kind, 'param' | 'optimizer', bytes, submitted, done) of every swapper read and write."""
    for kind in ("read", "write"):
        submit = getattr(swapper, kind)

        def traced(key, tensor, *how, submit=submit, kind=kind, **kw):  # how, kw: the swapper's priority
            t0, what, nbytes = time.perf_counter(), "param" if key.endswith(".param") else "optimizer", tensor.nbytes
            future = submit(key, tensor, *how, **kw)
            future.add_done_callback(lambda _: events.append((kind, what, nbytes, t0, time.perf_counter())))
            return future
        setattr(swapper, kind, traced)


def busy(events: list) -> dict:
    """Per (kind, what): bytes, and seconds with at least one such transfer in flight (0 where none ran: a
    step may move no parameters)."""
    out = {}
    for kind, what in ((k, w) for k in ("read", "write") for w in ("optimizer", "param")):
        spans, seconds, end = sorted(e[3:] for e in events if e[:2] == (kind, what)), 0.0, float("-inf")
        for a, b in spans:  # the length of the union of the intervals
            seconds += max(0.0, b - max(a, end))
            end = max(end, b)
        out[f"{what}_{kind}"] = dict(bytes=sum(e[2] for e in events if e[:2] == (kind, what)), seconds=seconds)
    return out


def swap_totals(engine) -> dict:
    return dict(engine.swapper.stats._asdict()) if engine.swapper is not None else {}


class Probe:
    """One engine's timers and traced swap transfers."""

    def __init__(self, engine):
        self.engine, self.acc, self.events = engine, instrument(engine), []
        if engine.swapper is not None:
            trace_transfers(engine.swapper, self.events)

    def step(self, x, y) -> dict:
        engine, acc = self.engine, self.acc
        acc.clear()
        swap0 = swap_totals(engine)
        COMM.Barrier()
        t0 = time.perf_counter()
        _, loss = engine(x, y)
        t1 = time.perf_counter()
        unshard_fwd = acc["unshard"]
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        value = loss.item()
        t3 = time.perf_counter()
        swap1 = swap_totals(engine)
        return dict(total=t3 - t0, forward=t1 - t0, backward=t2 - t1, step=t3 - t2, loss=value, start=t0,
                    unshard=acc["unshard"], unshard_forward=unshard_fwd, adam=acc["adam"], publish=acc["publish"],
                    swap_wait=acc["swap_wait"], swap={k: swap1[k] - swap0[k] for k in swap1})

    def transfers(self, rows: list[dict]) -> None:
        starts = [r["start"] for r in rows] + [float("inf")]  # a transfer belongs to the step that submitted it
        for i, r in enumerate(rows):
            r["transfers"] = busy([e for e in self.events if starts[i] <= e[3] < starts[i + 1]])


def train(args) -> None:
    """One engine per --modes; each step, every engine takes its step in turn (rotating who goes first),
    so that the machine's load drifts hit all modes alike."""
    torch.set_num_interop_threads(1)
    corpus, engines, setup = rowlib.ByteCorpus(), {}, {}
    for mode in args.modes:
        t0, model = time.perf_counter(), rowlib.build_model("20M", args.seed)
        params = model.num_params()
        engines[mode] = zerompi.initialize(model, make_config(mode, args.dtype, args.swap, args))
        COMM.Barrier()
        setup[mode] = time.perf_counter() - t0
    probes, rows = {m: Probe(e) for m, e in engines.items()}, {m: [] for m in engines}
    for step in range(args.warmup + args.steps):
        x, y = rowlib.batch(corpus, args, step, COMM.Get_rank())
        turn = step % len(args.modes)
        for mode in args.modes[turn:] + args.modes[:turn]:
            rows[mode].append(probes[mode].step(x, y))
    gc.collect()
    mine = {}
    for mode, engine in engines.items():
        probes[mode].transfers(rows[mode])
        stats, swapper = engine.stats, engine.swapper
        mine[mode] = dict(steps=rows[mode], setup_s=setup[mode], model_state_bytes=stats.model_state_bytes,
                          swapped_bytes=stats.swapped_bytes, swap_totals=swap_totals(engine),
                          o_direct=swapper.direct if swapper is not None else None,
                          buckets=[dict(unit=b.layout.unit, padded=b.layout.padded_numel)
                                   for b in engine.sharded.buckets])
        engine.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ranks = COMM.gather(dict(modes=mine, rss_peak=peak, rss_end=rowlib.rss_bytes()), root=0)
    if COMM.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(dict(dtype=args.dtype, params=params, world_size=COMM.Get_size(),
                                                  modes=args.modes, ranks=ranks)))
    COMM.Barrier()


# ---- parity: optimizer_kwargs across offload modes ---------------------------

def tiny_gpt() -> GPT:  # the MPI tests' tiny GPT (tests/mpi/workers/common.py)
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=16, bias=False))


def tiny_run(mode: str, dtype: str, kwargs: dict, swap: str, args) -> dict[str, torch.Tensor]:
    cfg = make_config(mode, dtype, swap, args, optimizer_kwargs=kwargs).replace(bucket_mb=0.004, lr=1e-2)
    engine = zerompi.initialize(tiny_gpt(), cfg)
    gen = torch.Generator().manual_seed(1 + COMM.Get_rank())
    for _ in range(3):
        x = torch.randint(0, 256, (2, 32), generator=gen)
        _, loss = engine(x, torch.roll(x, -1, 1))
        engine.backward(loss)
        engine.step()
    full = engine.full_state_dict()
    engine.close()
    return full


def _ordered(t: torch.Tensor) -> torch.Tensor:
    i = t.detach().contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)  # adjacent floats map to adjacent integers


def differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    """Share of elements that differ; largest distance in units in the last place of the element (large near zero)
    and of the tensor's largest entry. All 0: bitwise equal."""
    differing = ulp = top = 0
    for x, y in zip(a, b):
        x, y = x.detach(), y.detach()
        differing += int((x != y).sum())
        ulp = max(ulp, int((_ordered(x) - _ordered(y)).abs().max()))
        m = x.abs().max()
        top = max(top, float((x - y).abs().max() / (torch.nextafter(m, m + 1) - m)))
    return dict(differing=differing / sum(x.numel() for x in a), max_ulp=ulp, max_ulp_of_largest=top)


def parity(args) -> None:
    rows = []
    for dtype in ("fp32", "bf16"):
        default = tiny_run("none", dtype, {"foreach": False}, args.swap, args)  # torch's for-loop kernel
        for kwargs in ({}, {"foreach": False}, {"foreach": True}, {"fused": True}):  # {}: zerompi's default (fused)
            runs = {mode: tiny_run(mode, dtype, kwargs, args.swap, args) for mode in ("none", "cpu", "nvme")}
            rows.append(dict(dtype=dtype, optimizer_kwargs=kwargs,
                             vs_none={m: differ(list(runs["none"].values()), list(r.values()))
                                      for m, r in runs.items()},
                             vs_default_kernel=differ(list(default.values()), list(runs["none"].values()))))
    if COMM.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(dict(world_size=COMM.Get_size(), rows=rows)))
    COMM.Barrier()


# ---- adam: the CPU optimizer kernels ------------------------------------------

KERNELS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def flat_buckets(total: int, bucket_mb: float) -> list[int]:
    """``total`` fp32 elements cut into buckets of ``bucket_mb`` MiB, as zerompi's master shards are."""
    cap = int(bucket_mb * 2**20) // 4
    return [cap] * (total // cap) + ([total % cap] if total % cap else [])


def adam_optimizers(sizes: list[int], args) -> dict[str, torch.optim.AdamW]:
    """One AdamW per kernel on its own copy of the same initial values, all sharing one set of grads."""
    gen = torch.Generator().manual_seed(args.seed)
    init = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).mul_(1e-3) for n in sizes]
    opts = {}
    for name, kwargs in KERNELS.items():
        params = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(params, grads):
            p.grad = g  # AdamW does not modify gradients: sharing them is safe
        opts[name] = torch.optim.AdamW(params, lr=args.lr, betas=rowlib.BETAS, eps=rowlib.EPS,
                                       weight_decay=args.weight_decay, **kwargs)
    return opts


def adam_size(total: int, steps: int, args) -> list[dict]:
    opts = adam_optimizers(flat_buckets(total, args.bucket_mb), args)
    times = defaultdict(list)
    order = list(KERNELS)
    for rep in range(args.warmup + steps):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name in order[rep % 3:] + order[:rep % 3]:  # rotate: no kernel always runs first
                t0 = time.perf_counter()
                opts[name].step()
                if rep >= args.warmup:  # the first step also allocates the state
                    times[name, threads].append(time.perf_counter() - t0)

    def tensors(opt):
        ps = opt.param_groups[0]["params"]
        return {"param": ps, "exp_avg": [opt.state[p]["exp_avg"] for p in ps],
                "exp_avg_sq": [opt.state[p]["exp_avg_sq"] for p in ps]}
    ref = tensors(opts["default"])
    same = {name: {k: differ(ref[k], v) for k, v in tensors(opt).items()} for name, opt in opts.items()}
    taken, med = 2 * (args.warmup + steps), {key: statistics.median(v) for key, v in times.items()}
    return [dict(numel=total, buckets=len(opts["default"].param_groups[0]["params"]), kernel=name,
                 threads=threads, seconds=times[name, threads], steps_taken=taken, vs_default=same[name],
                 speedup_vs_default=med["default", threads] / med[name, threads],
                 speedup_vs_default_1thread=med["default", 1] / med[name, threads])
            for name in KERNELS for threads in (1, 2)]


def adam(args) -> None:
    rows = [row for total, steps in zip(args.adam_numel, args.adam_steps) for row in adam_size(total, steps, args)]
    Path(args.out).write_text(json.dumps(dict(torch=torch.__version__, rows=rows)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", choices=("none", "cpu", "nvme"), default=["none"])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--swap", help="directory for the swap files (nvme, --parity)")
    p.add_argument("--out", required=True, help="JSON results (rank 0)")
    rowlib.add_training_args(p, steps=5)
    p.add_argument("--parity", action="store_true", help="run the optimizer_kwargs parity check instead")
    p.add_argument("--adam", action="store_true", help="time the AdamW kernels instead (one rank)")
    p.add_argument("--adam-numel", type=int, nargs="+", default=[19_177_472, 120_000_000])
    p.add_argument("--adam-steps", type=int, nargs="+", default=[5, 2], help="timed steps per --adam-numel")
    args = p.parse_args()
    parity(args) if args.parity else adam(args) if args.adam else train(args)


if __name__ == "__main__":
    main()
