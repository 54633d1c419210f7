"""What bench_quant_speed.py times: codec kernels, collectives with and without codes, a GPT step.

    python benchmarks/workers/quant_speed_worker.py kernels --out F            # one process, one thread
    mpiexec -n N python -m mpi4py benchmarks/workers/quant_speed_worker.py collectives --numel S --out F
    mpiexec -n N python -m mpi4py benchmarks/workers/quant_speed_worker.py step --variant w8g4 --out F

Each mode writes one JSON document to ``--out`` (rank 0). Times are per call, after warm-up,
every repeat kept (the driver takes medians and spreads).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from zerompi.comm.codec import BlockCodec  # noqa: E402

CPU = time.process_time  # kernels: this process's CPU seconds (the machine is shared; wall time counts others)
VARIANTS = {"none": {}, "w8g8": dict(quantize_weights="int8", quantize_grads="int8"),
            "w8g4": dict(quantize_weights="int8", quantize_grads="int4"),
            "w8g4-ef": dict(quantize_weights="int8", quantize_grads="int4", grad_error_feedback=True)}


def timed(fn, repeats: int, warmup: int = 1, clock=time.perf_counter) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def gpt_vectors() -> tuple[torch.Tensor, torch.Tensor]:
    """The default job's GPT: its flat weights and the flat gradient of one batch (real values to quantize)."""
    from zerompi.models.gpt import GPT, gpt_config_from_dict
    doc = tomllib.loads((ROOT / "jobs" / "configs" / "default.toml").read_text())
    torch.manual_seed(0)
    model = GPT(gpt_config_from_dict(doc["model"]))
    x = torch.randint(0, 256, (8, 129))
    model(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1].backward()
    params = [p for p in model.parameters()]
    return (torch.cat([p.detach().reshape(-1) for p in params]),
            torch.cat([p.grad.reshape(-1) for p in params]))


def kernels(args) -> dict:
    torch.set_num_threads(1)
    rows = []
    for numel in (2**20, 2**24):
        x = torch.randn(numel)
        residual = torch.zeros(numel)
        for bits in (8, 4):
            codec = BlockCodec(bits, 256)
            packed = codec.encode(x, numel // 2)
            for op, fn in (("encode", lambda: codec.encode(x, numel // 2)),
                           ("encode+residual", lambda: codec.encode(x + residual, numel // 2, residual)),
                           ("decode", lambda: codec.decode(packed, numel // 2))):
                rows.append(dict(op=op, codec=codec.name, numel=numel, seconds=timed(fn, args.repeats, clock=CPU)))
        rows.append(dict(op="copy fp32", codec="-", numel=numel,
                         seconds=timed(lambda: x.clone(), args.repeats, clock=CPU)))
        rows.append(dict(op="sum of 2 fp32 chunks", codec="-", numel=numel,
                         seconds=timed(lambda: x.view(2, -1).sum(dim=0), args.repeats, clock=CPU)))
    weights, grads = gpt_vectors()
    errors = []
    for block in (32, 64, 128, 256, 512, 1024, 4096):
        for bits in (8, 4):
            codec = BlockCodec(bits, block)
            for what, v in (("weights", weights), ("gradients", grads)):
                n = v.numel() - v.numel() % 2
                y = codec.decode(codec.encode(v[:n], n), n).reshape(-1)
                errors.append(dict(block=block, codec=codec.name, what=what, bytes_per_element=codec.nbytes(n) / n,
                                   rel_l2=float((v[:n] - y).norm() / v[:n].norm())))
    return dict(mode="kernels", threads=1, clock="process_time", rows=rows, errors=errors)


def collectives(args) -> dict:
    from mpi4py import MPI
    from zerompi.comm.compressed import CompressedGroup
    from zerompi.comm.mpi import MPIGroup
    torch.set_num_threads(1)
    group = MPIGroup(MPI.COMM_WORLD)
    n, s = group.size, args.numel
    full = torch.randn(n * s)
    shard = torch.randn(s)
    shard16, full16 = shard.bfloat16(), full.bfloat16()
    out32, out16 = torch.empty(n * s), torch.empty(n * s, dtype=torch.bfloat16)
    ops = {
        "all_gather fp32": lambda: group.all_gather(shard, out32),
        "all_gather bf16": lambda: group.all_gather(shard16, out16),
        "reduce_scatter fp32": lambda: group.reduce_scatter(full).wait(),
        "reduce_scatter bf16 (all-to-all, sum)": lambda: group.reduce_scatter(full16).wait(),
    }
    for bits in (8, 4):
        codec = BlockCodec(bits, 256)
        comm = CompressedGroup(group, codec)
        packed = codec.encode(shard, s)
        if bits == 8:
            ops["all_gather int8 (codes only)"] = lambda p=packed, c=comm: c.all_gather(p, out32, chunk=s)
        ops[f"reduce_scatter {codec.name} (encode, all-to-all, decode, sum)"] = lambda c=comm: c.reduce_scatter(full)
        blob = codec.encode(full, s)
        recv = torch.empty_like(blob)
        ops[f"all_to_all of the {codec.name} codes alone"] = lambda b=blob, r=recv: group.all_to_all(b, r)
    rows = []
    for name, fn in ops.items():
        def call(fn=fn):
            group.barrier()
            fn()
        times = timed(call, args.repeats, warmup=2)
        worst = [max(t) for t in zip(*MPI.COMM_WORLD.allgather(times))]  # the slowest rank, per call
        rows.append(dict(op=name, numel=s, ranks=n, seconds=worst))
    return dict(mode="collectives", ranks=n, numel=s, rows=rows)


def step(args) -> dict:
    from mpi4py import MPI
    import zerompi
    from zerompi.models.gpt import GPT, gpt_config_from_dict
    doc = tomllib.loads((ROOT / "jobs" / "configs" / "default.toml").read_text())
    zero = {k: v for k, v in doc["zero"].items() if k not in ("lr_schedule", "warmup_steps", "total_steps", "min_lr")}
    cfg = zerompi.ZeroConfig(**zero, **VARIANTS[args.variant], cpu_threads=1)
    torch.manual_seed(0)
    engine = zerompi.initialize(GPT(gpt_config_from_dict(doc["model"])), cfg)
    g = torch.Generator().manual_seed(engine.rank)
    batch = doc["train"]["micro_batch"]

    def one() -> None:
        x = torch.randint(0, 256, (batch, 129), generator=g)
        engine.backward(engine(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1])
        engine.step()
        MPI.COMM_WORLD.Barrier()
    times = timed(one, args.steps, warmup=args.warmup)
    before = dict(engine.stats.bytes_sent)
    one()
    per_step = {k: v - before.get(k, 0) for k, v in engine.stats.bytes_sent.items() if v != before.get(k, 0)}
    engine.close()
    return dict(mode="step", variant=args.variant, ranks=MPI.COMM_WORLD.Get_size(), seconds=times,
                bytes_per_step=per_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("kernels", "collectives", "step"))
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--numel", type=int, default=2**20)
    p.add_argument("--variant", choices=tuple(VARIANTS), default="none")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    doc = {"kernels": kernels, "collectives": collectives, "step": step}[args.mode](args)
    if args.mode == "kernels":
        rank = 0
    else:
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        Path(args.out).write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
