"""One timed training run for bench_ulfm.py: an MLP at stage 3, reproducible=True, with or without
fault_tolerance, optionally with world rank --kill-rank SIGKILLing itself at the start of step --kill-step
(after writing the wall time to --kill-time). Rank 0 of the final group prints one JSON line: per-step wall
times, the recovery reports, the world size, and the wall time the first step after a recovery ended."""
import argparse
import json
import os
import resource
import signal
import time

import torch
from mpi4py import MPI
from torch import nn

import zerompi

p = argparse.ArgumentParser()
p.add_argument("--ft", default="off")
p.add_argument("--every", type=int, default=1)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--width", type=int, default=512)
p.add_argument("--micro-batches", type=int, default=8)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--kill-time", default=None, help="file the killed rank writes its wall time to first")
p.add_argument("--recovery-dir", default=None)
p.add_argument("--source", default="memory", help="recovery_source")
a = p.parse_args()
torch.manual_seed(0)
w = a.width
model = nn.Sequential(nn.Linear(64, w), nn.GELU(), nn.Linear(w, w), nn.GELU(), nn.Linear(w, w), nn.GELU(),
                      nn.Linear(w, 16))
cfg = zerompi.ZeroConfig(stage=3, reproducible=True, micro_batches=a.micro_batches, cpu_threads=1, device="cpu",
                         bucket_mb=1.0, checkpoint_layout="per_rank", fault_tolerance=a.ft == "on",
                         recovery_every=a.every, recovery_dir=a.recovery_dir, recovery_source=a.source)
engine = zerompi.initialize(model, cfg)
params = sum(q.numel() for q in model.parameters())
times, reports, first_done = {}, [], None
while engine.stats.steps < a.steps:
    step = engine.stats.steps
    try:
        start = time.perf_counter()
        if step == a.kill_step and MPI.COMM_WORLD.Get_rank() == a.kill_rank:
            if a.kill_time:
                with open(a.kill_time, "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        for i in engine.micro_batch_indices():
            g = torch.Generator().manual_seed(1000 * step + i)
            x, y = torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)
            engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        times[step] = time.perf_counter() - start  # a replayed step keeps its last time
        if reports and first_done is None:
            first_done = time.time()  # the first step done after the recovery
    except zerompi.Recovered as r:
        reports.append(dict(r.report.__dict__))
points = getattr(getattr(engine, "recovery", None), "points", None)
held = [p.own.numel() + p.held.numel() for p in getattr(points, "points", [])[-1:]]  # one point, own + copy
peak = engine.group.allgather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
replicas = engine.group.allgather_object(held[0] if held else 0)
if engine.rank == 0:
    print(json.dumps(dict(ft=a.ft, every=a.every, source=a.source, params=params, world=engine.world_size,
                          times=[times[s] for s in sorted(times)], reports=reports, first_done=first_done,
                          peak_rss=max(peak), replica_bytes=max(replicas))), flush=True)
engine.close()
