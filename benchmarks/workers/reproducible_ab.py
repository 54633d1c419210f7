"""Both modes in one job, taking turns step by step: the GPT of jobs/configs/default.toml under the
default mode (grad_accum_steps = G / N) and under reproducible=True (micro_batches = G), each its own
engine over its own copy of the model. Alternating single steps puts any drift of the machine on both
sides alike. Rank 0 writes, per mode, every timed step's seconds and bytes sent.

    mpiexec -n N python -m mpi4py benchmarks/workers/reproducible_ab.py --out F.json [--steps 12] [--g 4]
"""
import argparse
import json
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import zerompi
from zerompi.models.corpus import ByteCorpus
from zerompi.models.gpt import GPT, gpt_config_from_dict

ROOT = Path(__file__).resolve().parents[2]
COMM = MPI.COMM_WORLD


def generator(*coords: int) -> torch.Generator:
    state = np.random.SeedSequence(list(coords)).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--g", type=int, default=4, help="micro-batches per step over all ranks")
    p.add_argument("--stage", type=int, help="default: the config's")
    a = p.parse_args()
    doc = tomllib.loads((ROOT / "jobs/configs/default.toml").read_text())
    zero = {**doc["zero"], "cpu_threads": 1, **({"stage": a.stage} if a.stage is not None else {})}
    n, rank = COMM.size, COMM.rank
    cfgs = {"default": zerompi.ZeroConfig.from_dict({**zero, "grad_accum_steps": a.g // n}),
            "reproducible": zerompi.ZeroConfig.from_dict({**zero, "grad_accum_steps": 1, "reproducible": True,
                                                          "micro_batches": a.g})}
    gpt = gpt_config_from_dict(doc["model"])
    data = ByteCorpus(max_bytes=1_000_000)
    engines = {}
    for mode, cfg in cfgs.items():
        torch.manual_seed(doc["train"]["seed"])
        engines[mode] = zerompi.initialize(GPT(gpt), cfg)
    mb, T = doc["train"]["micro_batch"], gpt.block_size
    times = {m: [] for m in engines}
    sent = {m: [] for m in engines}
    kinds = {m: {} for m in engines}  # the last timed step's bytes per collective kind, summed over ranks

    def one_step(mode: str, step: int) -> None:
        engine = engines[mode]
        gens = [generator(1, step, i) for i in engine.micro_batch_indices()] if mode == "reproducible" else \
            [generator(1, step, k, rank) for k in range(a.g // n)]
        for g in gens:
            x, y = data.get_batch("train", mb, T, g)
            engine.backward(engine(x, y)[1])
        engine.step()

    for step in range(a.warmup + a.steps):
        order = list(engines) if step % 2 == 0 else list(engines)[::-1]
        for mode in order:
            COMM.Barrier()
            before = dict(engines[mode].stats.bytes_sent)
            t0 = time.perf_counter()
            one_step(mode, step)
            COMM.Barrier()
            dt = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if step >= a.warmup:
                after = engines[mode].stats.bytes_sent
                mine = {k: after[k] - before.get(k, 0) for k in after}  # the kinds may differ by rank
                delta = {}
                for d in COMM.allgather(mine):
                    for k, v in d.items():
                        delta[k] = delta.get(k, 0) + v
                times[mode].append(dt)
                sent[mode].append(sum(delta.values()))
                kinds[mode] = {k: v for k, v in delta.items() if v}
    if rank == 0:
        Path(a.out).write_text(json.dumps(dict(ranks=n, g=a.g, stage=cfgs['default'].stage, times=times,
                                               bytes_sent=sent, kinds=kinds)))
    for e in engines.values():
        e.close()


if __name__ == "__main__":
    main()
