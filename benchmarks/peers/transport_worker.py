"""Replay the collectives of one step of each row on one transport (run under mpiexec).

    mpiexec -n 2 python -m mpi4py benchmarks/peers/transport_worker.py --transport mpi --plan plan.json --out r.json

``--plan``: a JSON object ``{row: [call, ...]}`` with the calls calltrace.py recorded in one
timed step of that row at this world size. Every call is issued in order, blocking, on fresh
buffers of the recorded size (fp32 as recorded), with nothing computed in between:

- ``--transport mpi``: mpi4py on MPI_COMM_WORLD, the calls zerompi/comm/mpi.py makes
  (``Reduce_scatter_block``, ``Allgather``, ``Allreduce(IN_PLACE)``, ``Bcast``, ``Reduce``, ``Alltoall``
  on the tensors themselves); under MPICH on one node that is its shared-memory transport. 16-bit
  tensors as zerompi moves them: gathered and broadcast as int16 views, reduce-scattered as an
  ``Alltoall`` of int16 views whose received chunks are summed in fp32.
- ``--transport gloo``: torch.distributed over gloo, rendezvous on 127.0.0.1 like the peer rows
  (rowlib.init_torch_distributed); the function the row called where it is a torch.distributed
  one, else (zerompi's calls) ``reduce_scatter_single`` / ``all_gather_single`` / ``all_reduce`` /
  ``broadcast``.

Each row's sequence runs ``--warmup`` times untimed, then ``--iters`` times timed, every
iteration starting at a barrier; an iteration's time is the slowest rank's. Rank 0 writes
``{row: {"times": [...], "op_s": {op: seconds in that op, rank 0, median over iterations}}}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, os.environ.get("ZEROMPI_BENCH_TREE") or str(Path(__file__).resolve().parents[2]))  # as rowlib.py
from mpi4py import MPI  # noqa: E402

import rowlib  # noqa: E402

DTYPES = {4: torch.float32, 8: torch.float64, 2: torch.bfloat16}
ZEROMPI_TO_TORCH = {"reduce_scatter": "reduce_scatter_single", "all_gather": "all_gather_single",
                    "all_reduce": "all_reduce", "broadcast": "broadcast"}


class Buffers:
    """One set of tensors per (op, numel, dtype), reused across calls and iterations."""

    def __init__(self, n: int):
        self.n, self.cache = n, {}

    def get(self, op: str, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (op, numel, dtype)
        if key not in self.cache:
            full = torch.randn(numel).to(dtype)
            part = torch.empty(max(1, numel // self.n), dtype=dtype)
            self.cache[key] = (full, part)
        return self.cache[key]


def _mpi_16bit(comm: MPI.Comm, op: str, full: torch.Tensor, part: torch.Tensor, n: int):
    """A 16-bit call as zerompi makes it: MPI moves the bits (int16); a sum happens in fp32 after."""
    raw_full, raw_part = full.view(torch.int16), part.view(torch.int16)
    if op == "reduce_scatter":
        recv = torch.empty_like(raw_full)
        return lambda: (comm.Alltoall(raw_full, recv), recv.view(full.dtype).view(n, -1).float().sum(0))
    if op == "all_gather":
        return lambda: comm.Allgather(raw_part[:full.numel() // n], raw_full)
    if op == "broadcast":
        return lambda: comm.Bcast(raw_full, root=0)
    raise ValueError(f"no 16-bit MPI replay for {op} (MPI cannot sum 16-bit floats; zerompi never asks it to)")


def mpi_call(comm: MPI.Comm, c: dict, bufs: Buffers):
    """The call as zerompi makes it (zerompi/comm/mpi.py), as a thunk."""
    op, n = c["op"], comm.Get_size()
    full, part = bufs.get(op, c["numel"], DTYPES[c["itemsize"]])
    if full.element_size() == 2:
        return _mpi_16bit(comm, op, full, part, n)
    if op == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(full, part, op=MPI.SUM)
    if op == "all_gather":
        return lambda: comm.Allgather(part[:c["numel"] // n], full)
    if op == "all_reduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, full, op=MPI.SUM)
    if op == "broadcast":
        return lambda: comm.Bcast(full, root=0)
    if op == "reduce":
        return lambda: comm.Reduce(MPI.IN_PLACE if comm.Get_rank() == 0 else full, full, op=MPI.SUM, root=0)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: comm.Alltoall(full, out)
    raise ValueError(f"no MPI replay for {op}")


def gloo_call(c: dict, bufs: Buffers):
    """The torch.distributed call the row made (zerompi's: the tensor-form equivalent), as a thunk."""
    import torch.distributed as dist
    n = dist.get_world_size()
    fn = c["fn"].removeprefix("ProcessGroup.")
    fn = ZEROMPI_TO_TORCH[fn] if c["fn"].startswith("ProcessGroup.") else fn
    full, part = bufs.get(c["op"], c["numel"], DTYPES[c["itemsize"]])
    shard = part[:c["numel"] // n]
    f = getattr(dist, fn)
    if fn == "all_reduce":
        return lambda: f(full)
    if fn in ("broadcast", "reduce"):
        return lambda: f(full, 0)
    if fn == "all_reduce_coalesced":
        return lambda: dist.all_reduce(full)
    if fn in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return lambda: f(shard, full)
    if fn == "reduce_scatter":
        chunks = list(full.chunk(n))
        return lambda: f(shard, chunks)
    if fn in ("all_gather_single", "all_gather_into_tensor"):
        return lambda: f(full, shard)
    if fn == "all_gather":
        chunks = list(full.chunk(n))
        return lambda: f(chunks, shard)
    if fn == "all_to_all_single":
        out = torch.empty_like(full)
        return lambda: f(out, full)
    raise ValueError(f"no gloo replay for {fn}")


def replay(comm: MPI.Comm, calls: list[dict], transport: str, bufs: Buffers, warmup: int, iters: int) -> dict:
    thunks = [(c["op"], mpi_call(comm, c, bufs) if transport == "mpi" else gloo_call(c, bufs)) for c in calls]
    times, op_s = [], defaultdict(list)
    for it in range(warmup + iters):
        comm.Barrier()
        spent = defaultdict(float)
        t0 = time.perf_counter()
        for op, thunk in thunks:
            a = time.perf_counter()
            thunk()
            spent[op] += time.perf_counter() - a
        dt = time.perf_counter() - t0
        if it >= warmup:
            times.append(dt)
            for op, s in spent.items():
                op_s[op].append(s)
    every = comm.gather(times, root=0)
    if comm.Get_rank() != 0:
        return {}
    slowest = [max(r[i] for r in every) for i in range(iters)]
    return dict(times=slowest, median=statistics.median(slowest),
                op_s={op: statistics.median(v) for op, v in op_s.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transport", choices=("mpi", "gloo"), required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")  # torch's deprecation notices of all_gather_into_tensor & co.
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    plan = json.loads(Path(args.plan).read_text())
    if args.transport == "gloo":
        rowlib.init_torch_distributed(comm)
    bufs = Buffers(comm.Get_size())
    out = {row: replay(comm, calls, args.transport, bufs, args.warmup, args.iters) for row, calls in plan.items()}
    if comm.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    comm.Barrier()
    if args.transport == "gloo":
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
