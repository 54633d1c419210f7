"""What crosses a node's link while hsdp and hpZ train (tests/mpi/test_cluster.py, on jobs/cluster/up.sh's nodes).

Per hierarchy (``--hierarchies``): stage 3, fp32, one micro-batch per step, every parameter sharded
(no persistent ones), WARMUP steps first (wire-up, first gathers), then the node-local rank 0 of each
node reads its node's own link counters (/sys/class/net/eth0/statistics/{tx,rx}_bytes: the node's
network namespace has eth0 only, its one link to the bridge) between barriers, before and after
``--steps`` steps. Rank 0 writes per hierarchy: the padded parameter count P, the steps, and each
node's bytes sent and received over its link during them. The engine's own accounting
(stats.bytes_sent) is written beside, and not used by the checks. ``--started FILE``: rank 0 writes
FILE after the warm-up steps (a test that breaks a node during training waits for it);
``--hang-floor S``: the watchdog's hang_floor; ``--hang-dir D``: its hang_dir.
"""
import argparse
import socket
import time

import torch
from mpi4py import MPI
from torch import nn

import zerompi
from common import write_json

COMM = MPI.COMM_WORLD
WARMUP = 2
STATS = "/sys/class/net/eth0/statistics/"


def link() -> tuple[int, int]:
    with open(STATS + "tx_bytes") as tx, open(STATS + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))  # 525,568 parameters


def measure(hierarchy: str, steps: int, local: MPI.Intracomm, started=None, hang_floor=None, hang_dir=None) -> dict:
    cfg = zerompi.ZeroConfig(stage=3, hierarchy=hierarchy, dtype="fp32", lr=1e-3, seed=0,
                             param_persistence_threshold=0, cpu_threads=1, abort_on_exception=False, hang_dir=hang_dir,
                             **(dict(hang_floor=hang_floor) if hang_floor else {}))
    engine = zerompi.initialize(model(), cfg)
    gen = torch.Generator().manual_seed(COMM.rank)
    x, y = torch.randn(8, 256, generator=gen), torch.randn(8, 256, generator=gen)

    def train(n):
        for _ in range(n):
            engine.backward(nn.functional.mse_loss(engine(x), y))
            assert engine.step()

    train(WARMUP)
    COMM.Barrier()
    if started and COMM.rank == 0:
        with open(started, "w") as f:
            f.write(f"{time.time()}\n")
    before = link() if local.rank == 0 else None
    COMM.Barrier()
    start = time.monotonic()
    train(steps)
    COMM.Barrier()
    seconds = time.monotonic() - start
    after = link() if local.rank == 0 else None
    COMM.Barrier()
    node = (socket.gethostname(), after[0] - before[0], after[1] - before[1]) if local.rank == 0 else None
    nodes = [n for n in COMM.allgather(node) if n is not None]
    padded = sum(b.layout.padded_numel for b in engine.sharded.buckets)
    shard_group = {b.layout.world_size for b in engine.sharded.buckets}
    out = dict(hierarchy=hierarchy, steps=steps, padded=padded, shard_group=sorted(shard_group), seconds=seconds,
               tx={n: t for n, t, _ in nodes}, rx={n: r for n, _, r in nodes},
               bytes_sent=dict(engine.stats.bytes_sent))
    engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--hierarchies", default="hsdp,hpz")
    p.add_argument("--started")
    p.add_argument("--hang-floor", type=float)
    p.add_argument("--hang-dir")
    a = p.parse_args()
    local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    rows = [measure(h, a.steps, local, a.started, a.hang_floor, a.hang_dir) for h in a.hierarchies.split(",")]
    if COMM.rank == 0:
        write_json(a.out, dict(world=COMM.size, rows=rows))


if __name__ == "__main__":
    main()
