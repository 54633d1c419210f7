"""One launch of benchmarks/bench_cluster.py on jobs/cluster/up.sh's nodes: every row of one family, in turn.

Run by ``srun -N R --ntasks-per-node=s --mpi=pmi2 python -m mpi4py cluster_worker.py --family F --out FILE``
inside the cluster. Every row trains the same GPT (benchmarks/peers/rowlib.py's model, data and AdamW
settings; ``--size``, one micro-batch of ``--micro-batch`` sequences a rank) from the same seed:
``--warmup`` untimed steps, then ``--steps`` timed ones, each started together (a barrier) and timed on
the slowest rank. Around the timed steps the node-local rank 0 of each node reads its node's own link
counters (/sys/class/net/eth0/statistics: eth0 is the node's one link to the bridge), between barriers,
so the bytes a row moves between nodes are the kernel's count, not the framework's.

Families (each a launch of its own, so that one framework's patches never reach another's rows):
  zerompi    stages 0-3 x flat / hsdp (stages 1-3) / hpz (stage 3), each also with int8 weights and
             int8 gradients (``-q``; stages 1-3)
  torch      DDP; FSDP2 ``fully_shard`` over all ranks; FSDP2 HSDP (a 2-D mesh: replicate across
             nodes, shard within)
  deepspeed  ZeRO-3; ZeRO++ hpZ (``zero_hpz_partition_size`` = ranks per node), qwZ and qgZ (int8
             weights, int4 gradients), where DeepSpeed runs them on the CPU
The torch.distributed rows rendezvous over gloo at node 1 (MASTER_ADDR/MASTER_PORT from the driver).
A row that raises is recorded with its error and the launch goes on. Rank 0 writes one JSON file.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
import rowlib  # noqa: E402
from zerompi.models.corpus import ByteCorpus  # noqa: E402

COMM = MPI.COMM_WORLD
STATS = "/sys/class/net/eth0/statistics/"
ZEROMPI_ROWS = (["z0-flat"] + [f"z{s}-{h}{q}" for s in (1, 2, 3) for h in ("flat", "hsdp") for q in ("", "-q")]
                + ["z3-hpz", "z3-hpz-q"])
FAMILIES = {"zerompi": ZEROMPI_ROWS, "torch": ["ddp", "fsdp2", "fsdp2-hsdp"],
            "deepspeed": ["ds3", "ds3-hpz", "ds3-qwz-qgz"]}


def one_way_latency(partner: int, rounds: int = 200) -> float | None:
    """Half the median round trip of a 1-byte MPI message between rank 0 and ``partner`` (the first rank of
    node 2): the alpha of the links as MPI sees them (seconds; None on one node)."""
    if partner >= COMM.size:
        return None
    buf, trips = bytearray(1), []
    COMM.Barrier()
    for _ in range(rounds):
        if COMM.rank == 0:
            start = time.perf_counter()
            COMM.Send(buf, dest=partner)
            COMM.Recv(buf, source=partner)
            trips.append(time.perf_counter() - start)
        elif COMM.rank == partner:
            COMM.Recv(buf, source=0)
            COMM.Send(buf, dest=0)
    COMM.Barrier()
    return COMM.bcast(statistics.median(trips) / 2 if COMM.rank == 0 else None)


def link() -> tuple[int, int]:
    with open(STATS + "tx_bytes") as tx, open(STATS + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


class Closing:
    """A row's trainer and how to let go of it."""

    def __init__(self, trainer: rowlib.Trainer, close=lambda: None):
        self.trainer, self.close = trainer, close


def zerompi_row(key: str, model, args, nodes: int, per_node: int) -> Closing:
    import zerompi
    stage, hierarchy, *q = key[1:].split("-")
    quant = dict(quantize_weights="int8", quantize_grads="int8") if q else {}
    cfg = zerompi.ZeroConfig(stage=int(stage), hierarchy=hierarchy, optimizer="adamw", lr=args.lr,
                             betas=rowlib.BETAS, eps=rowlib.EPS, weight_decay=args.weight_decay,
                             bucket_mb=args.bucket_mb, cpu_threads=1, seed=args.seed, **quant)
    engine = zerompi.initialize(model, cfg, comm=COMM)
    from zerompi.tools.commtime import collectives
    calls = len(engine.sharded.buckets) * len(collectives(int(stage))) if int(stage) else len(engine.sharded.buckets)
    return Closing(rowlib.Trainer(step=rowlib.engine_step(engine), bytes_sent=lambda: dict(engine.stats.bytes_sent),
                                  info=dict(collectives_per_step=calls)), engine.close)


def torch_row(key: str, model, args, nodes: int, per_node: int) -> Closing:
    kwargs = dict(lr=args.lr, betas=rowlib.BETAS, eps=rowlib.EPS, weight_decay=args.weight_decay)
    if key == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, bucket_cap_mb=args.bucket_mb)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = (init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
                if key == "fsdp2-hsdp" else init_device_mesh("cpu", (COMM.size,)))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **kwargs)
    return Closing(rowlib.Trainer(step=rowlib.torch_step(model, opt), bytes_sent=dict))


def deepspeed_row(key: str, model, args, nodes: int, per_node: int) -> Closing:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    zero = {"stage": 3}
    if "hpz" in key:
        zero["zero_hpz_partition_size"] = per_node
    if "qwz" in key:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=rowlib.BETAS, eps=rowlib.EPS,
                            weight_decay=args.weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return Closing(rowlib.Trainer(step=rowlib.engine_step(engine), bytes_sent=dict),
                   getattr(engine, "destroy", lambda: None))


BUILD = {"zerompi": zerompi_row, "torch": torch_row, "deepspeed": deepspeed_row}  # family -> a row's builder


def measure(key: str, family: str, args, corpus, local: MPI.Intracomm, nodes: int, per_node: int) -> dict:
    model = rowlib.build_model(args.size, args.seed)
    t0 = time.perf_counter()
    row = BUILD[family](key, model, args, nodes, per_node)
    torch.set_num_threads(1)
    setup_s = time.perf_counter() - t0
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            COMM.Barrier()
            before = link() if local.rank == 0 else None
            COMM.Barrier()
        x, y = rowlib.batch(corpus, args, step, COMM.rank)
        COMM.Barrier()
        start = time.perf_counter()
        losses.append(row.trainer.step(x, y))
        times.append(time.perf_counter() - start)
    COMM.Barrier()
    after = link() if local.rank == 0 else None
    COMM.Barrier()
    row.close()
    slowest = [max(ts) for ts in zip(*COMM.allgather(times[args.warmup:]))]
    node = (socket.gethostname(), after[0] - before[0], after[1] - before[1]) if local.rank == 0 else None
    nodes_seen = [n for n in COMM.allgather(node) if n is not None]
    return dict(row=key, family=family, setup_s=setup_s, step_s=statistics.median(slowest), step_s_all=slowest,
                loss_last=sum(COMM.allgather(losses[-1])) / COMM.size, **row.trainer.info,
                link_tx={h: t / args.steps for h, t, _ in nodes_seen},
                link_rx={h: r / args.steps for h, _, r in nodes_seen})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILIES), required=True)
    p.add_argument("--rows", help="comma-separated: only these of the family's rows")
    p.add_argument("--size", default="2M", choices=sorted(rowlib.MODEL_SIZES))
    rowlib.add_training_args(p, steps=5)
    p.set_defaults(micro_batch=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = local.size
    nodes = COMM.size // per_node
    if args.family != "zerompi":
        rowlib.init_torch_distributed(COMM)
    alpha = one_way_latency(per_node)
    corpus = ByteCorpus()
    keys = [k for k in FAMILIES[args.family] if not args.rows or k in args.rows.split(",")]
    results = []
    for key in keys:
        try:
            results.append(measure(key, args.family, args, corpus, local, nodes, per_node))
        except Exception as e:  # one row's failure is recorded; the others still run
            results.append(dict(row=key, family=args.family, error=f"{type(e).__name__}: {e}"[:400],
                                where=traceback.format_exc(limit=3)[-800:]))
            if COMM.size > 1 and args.family == "zerompi":
                break  # ranks may be out of step after an engine's error: the launch ends here
        gc.collect()
    if COMM.rank == 0:
        Path(args.out).write_text(json.dumps(dict(world=COMM.size, nodes=nodes, per_node=per_node, alpha_s=alpha,
                                                  rows=results)))


if __name__ == "__main__":
    main()
