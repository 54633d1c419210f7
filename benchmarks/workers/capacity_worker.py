"""One capacity trial: a GPT built on the meta device trains a few steps on N ranks.

    mpiexec -n 2 python -m mpi4py benchmarks/workers/capacity_worker.py --mode stage3-nvme \
        --n-layer 48 --n-embd 1024 --nvme DIR --out OUT.json

bench_capacity.py runs it inside a memory-capped cgroup; the job either finishes (rank 0
writes JSON: parameters, seconds per phase, peak RSS and model-state bytes per rank, losses)
or is killed by the kernel's OOM killer.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, uninstalled
import zerompi  # noqa: E402
from zerompi.models.gpt import GPT, GPTConfig  # noqa: E402
from procstat import peak_rss  # noqa: E402

MODES = {
    "stage0": dict(stage=0),
    "stage3": dict(stage=3),
    "stage3+cpu": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    # optimizer_in_backward: exact, and under NVMe it moves less and overlaps the rest with backward
    "stage3+nvme": dict(stage=3, offload_optimizer="nvme", offload_params="nvme", optimizer_in_backward=True),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--nvme", default=None)
    p.add_argument("--prefetch-units", type=int, default=None, help="ZeroConfig.prefetch_units (default: the config's)")
    p.add_argument("--in-backward", action="store_true", help="ZeroConfig.optimizer_in_backward=True")
    p.add_argument("--nvme-threads", type=int, default=None, help="ZeroConfig.nvme_threads (default: the config's)")
    p.add_argument("--nvme-block-kib", type=int, default=None, help="ZeroConfig.nvme_block_kib (default: the config's)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                              n_embd=args.n_embd, bias=False))
    params = sum(p.numel() for p in model.parameters())
    extra = {} if args.prefetch_units is None else {"prefetch_units": args.prefetch_units}
    if args.in_backward:
        extra["optimizer_in_backward"] = True
    for key in ("nvme_threads", "nvme_block_kib"):
        if getattr(args, key) is not None:
            extra[key] = getattr(args, key)
    cfg = zerompi.ZeroConfig(optimizer="adamw", lr=1e-4, dtype=args.dtype, cpu_threads=1, nvme_path=args.nvme,
                             **MODES[args.mode], **extra)
    engine = zerompi.initialize(model, cfg, param_init=model.init_module)
    times = {"initialize": time.perf_counter() - t0}
    data = torch.randint(0, 256, (1, args.block + 1), generator=torch.Generator().manual_seed(comm.rank))
    losses, steps, traffic, phases = [], [], [], []
    for _ in range(args.steps):
        before = engine.stats
        moved = (before.swap_read_bytes, before.swap_write_bytes)
        t = time.perf_counter()
        loss = engine(data[:, :-1], data[:, 1:])[1]
        t_fwd = time.perf_counter()
        engine.backward(loss)
        t_bwd = time.perf_counter()
        engine.step()
        t_step = time.perf_counter()
        losses.append(engine.all_reduce_mean(float(loss.detach())))
        steps.append(time.perf_counter() - t)
        phases.append({"forward": t_fwd - t, "backward": t_bwd - t_fwd, "step": t_step - t_bwd})
        after = engine.stats  # this rank's swap file traffic in the step (NVMe modes)
        traffic.append([after.swap_read_bytes - moved[0], after.swap_write_bytes - moved[1]])
    stats = engine.stats
    rows = comm.gather({"peak_rss": peak_rss(), "model_state_bytes": stats.model_state_bytes,
                        "swapped_bytes": stats.swapped_bytes, "swap_bytes_per_step": traffic}, root=0)
    engine.close()
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({
            "mode": args.mode, "n_layer": args.n_layer, "n_embd": args.n_embd, "params": params,
            "dtype": args.dtype, "world_size": comm.size, "units": len(engine.sharded.units),
            "initialize_s": times["initialize"], "step_s": steps, "phase_s": phases, "losses": losses,
            "prefetch_units": cfg.prefetch_units, "optimizer_in_backward": cfg.optimizer_in_backward,
            "finite": all(math.isfinite(x) for x in losses), "ranks": rows}))


if __name__ == "__main__":
    main()
