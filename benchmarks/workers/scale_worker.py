"""One world size of benchmarks/bench_scale.py: what initialize, memory and checkpoints cost per rank.

Every rank measures; rank 0 writes one JSON object with, per quantity, the slowest rank's time or the
largest rank's memory. A tiny model keeps the model's shard negligible, so what memory grows with N is
the process's and MPI's own.
"""
import argparse
import json
import time
from pathlib import Path

import torch
from mpi4py import MPI

import zerompi
from zerompi.checkpoint import schema
from zerompi.checkpoint.index import CheckpointIndex

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--root", required=True)
p.add_argument("--ranks-per-node", type=int, required=True)
p.add_argument("--layouts", default="per_rank,per_node")
p.add_argument("--stage", type=int, default=3)
p.add_argument("--width", type=int, default=128)
args = p.parse_args()
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()


def memory_kib() -> dict[str, int]:
    """This process's resident set and its proportional share of shared pages (MPI's segments)."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Dirty", "Private_Clean"):
            out[key] = int(value.split()[0])
    return out


def slowest(seconds: float) -> float:
    return comm.allreduce(seconds, op=MPI.MAX)


def largest(value: float) -> float:
    return comm.allreduce(value, op=MPI.MAX)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    w = args.width
    return torch.nn.Sequential(*(torch.nn.Linear(w, w) for _ in range(4)))


def config(layout: str = "per_rank") -> zerompi.ZeroConfig:
    return zerompi.ZeroConfig(stage=args.stage, optimizer="sgd", lr=0.01, momentum=0.9, cpu_threads=1,
                              ranks_per_node=args.ranks_per_node, checkpoint_layout=layout, bucket_mb=0.01)


def train(engine) -> None:
    x = torch.randn(4, args.width, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


row = {"world": world, "ranks_per_node": args.ranks_per_node, "stage": args.stage}
net = model()
comm.Barrier()
before = memory_kib()
t, cpu = time.perf_counter(), time.process_time()
engine = zerompi.initialize(net, config())
row["initialize_s"] = slowest(time.perf_counter() - t)
row["initialize_cpu_s"] = slowest(time.process_time() - cpu)  # this rank's own work, not its wait for a core
train(engine)
comm.Barrier()
after = memory_kib()
shard = engine.stats.model_state_bytes
row["model_params"] = sum(p.numel() for p in net.parameters())
row["model_state_bytes_per_rank"] = int(largest(shard))
row["rss_growth_kib"] = int(largest(after["Rss"] - before["Rss"]))
row["rss_beyond_shard_kib"] = int(largest(after["Rss"] - before["Rss"] - shard / 1024))
row["pss_growth_kib"] = int(largest(after["Pss"] - before["Pss"]))
row["private_growth_kib"] = int(largest((after["Private_Dirty"] + after["Private_Clean"])
                                        - (before["Private_Dirty"] + before["Private_Clean"])))
row["rss_kib"] = int(largest(after["Rss"]))
row["pss_kib"] = int(largest(after["Pss"]))
engine.close()

row["layouts"] = {}
for layout in args.layouts.split(","):
    root = Path(args.root) / layout
    engine = zerompi.initialize(model(), config(layout))
    train(engine)
    comm.Barrier()
    t = time.perf_counter()
    engine.save_checkpoint(root, "t")
    save_s = slowest(time.perf_counter() - t)
    t = time.perf_counter()
    index = CheckpointIndex.read(root / "t" / schema.INDEX)
    index_read_s = slowest(time.perf_counter() - t)
    comm.Barrier()
    t = time.perf_counter()
    engine.load_checkpoint(root, "t")
    load_s = slowest(time.perf_counter() - t)
    engine.close()
    if rank == 0:
        files = sorted(p.name for p in (root / "t").iterdir())
        meta = json.dumps({k: getattr(index, k) for k in index.__dataclass_fields__ if k != "version"})
        row["layouts"][layout] = {
            "save_s": save_s, "index_read_s": index_read_s, "load_s": load_s,
            "files": len(files), "shard_files": len([f for f in files if f != schema.INDEX]),
            "index_bytes": (root / "t" / schema.INDEX).stat().st_size, "index_json_bytes": len(meta),
            "index_files_entries": sum(len(r) for r in index.files)}
if rank == 0:
    Path(args.out).write_text(json.dumps(row))
