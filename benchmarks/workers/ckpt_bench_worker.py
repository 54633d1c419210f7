"""Checkpoint benchmark worker: zerompi's synchronous and asynchronous saves, cold loads, raw I/O and the
torch.distributed.checkpoint peer, of one GPT on N ranks, every row once per repeat.

    mpiexec -n N python -m mpi4py benchmarks/workers/ckpt_bench_worker.py --root DIR --out OUT.json

Builds the GPT twice: a zerompi stage-3 engine and FSDP2 (``fully_shard`` per block, as the peers benchmark
runs it, gloo), each taking one AdamW step so that the optimizer state exists. Then --repeats times, in this
order: zerompi's synchronous save, eviction of its files, cold load; a training step; an asynchronous save
(live shards), --overlap-steps steps while it writes, its wait; the same with checkpoint_async_copy; raw I/O
of as many bytes in every RAW_CONFIGS way (each rank its share, all ranks at once: O_DIRECT or buffered
pwrite of large blocks on several threads + fsync, evict, cold pread); DCP's save, cold load, a step,
async_save with the same overlapping steps and its wait. Each collective call is timed on every rank
between barriers; timers wrapped around zerompi's checkpoint functions at run time (its code is unchanged)
split each rank's time. Rank 0 writes JSON; each repeat's files are removed after it. The page-cache, raw I/O
and child-process helpers are in diskio.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]),  # run from a checkout, uninstalled
                str(Path(__file__).resolve().parents[1]),  # rawdisk.py
                str(Path(__file__).resolve().parents[1] / "peers")]  # the FSDP2 row of the peers benchmark
import rawdisk  # noqa: E402
import zerompi  # noqa: E402
from diskio import (RAW_CONFIGS, evict, files_under, raw_name, raw_read, raw_write,  # noqa: E402
                    resident_fraction, trim_heap)
from zerompi.checkpoint import rawio, reader, writer  # noqa: E402
from zerompi.models.gpt import GPT, GPTConfig  # noqa: E402

log = logging.getLogger("ckpt_bench_worker")
# ---- timers and memory ------------------------------------------------------
class Timers:
    """Seconds in functions wrapped at run time. A *phase* function records under its own name and
    encloses the calls it makes; others record as ``name@phase`` (e.g. ``crc32@verify``)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.phase = "call"

    def wrap(self, owner, name: str, key: str, phase: bool = False) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            outer = self.phase
            if phase:
                self.phase = key
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key if phase else f"{key}@{outer}"] += time.perf_counter() - t0
                self.phase = outer

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def instrument(timers: Timers) -> None:
    """Wrap the checkpoint functions whose time we split out (module globals and a class, looked up per call)."""
    timers.wrap(rawio.DataFile, "put", "write")        # per dataset: checksums and pwrite
    timers.wrap(rawio.DataFile, "close", "close", phase=True)  # HDF5 metadata, fsync (and verify)
    timers.wrap(rawio, "fsync_path", "fsync")
    timers.wrap(writer, "publish", "publish", phase=True)      # rank 0: index.h5, renames, latest
    timers.wrap(reader, "prepare", "prepare", phase=True)
    timers.wrap(reader, "apply", "apply", phase=True)
    timers.wrap(rawio.Reads, "wait", "read")  # waiting for the reads (pread + checksums), started as planned


def proc_status_bytes(key: str) -> int:
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith(key + ":"))


def timed_collective(comm, timers: Timers, fn) -> list[dict] | None:
    """Run ``fn`` on every rank between barriers; rank 0 gets each rank's seconds, CPU seconds, parts and
    peak RSS growth (and what ``fn`` returned, as "result"). Free heap memory goes back to the system
    first, so that every call pays for the pages it allocates (as in a fresh job)."""
    trim_heap()
    comm.Barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    rss0 = proc_status_bytes("VmRSS")
    timers.take()
    t0, cpu0 = time.perf_counter(), time.process_time()
    result = fn()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    row = {"seconds": seconds, "cpu_seconds": cpu, "parts": timers.take(),
           "peak_rss_growth": proc_status_bytes("VmHWM") - rss0, "result": result}
    return comm.gather(row, root=0)


# ---- the job ----------------------------------------------------------------
def gpt(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                         n_embd=args.n_embd))


def batch(args, rank: int, step: int):
    data = torch.randint(0, 256, (1, args.block + 1), generator=torch.Generator().manual_seed(1000 * step + rank))
    return data[:, :-1], data[:, 1:]


def build_engine(args, rank: int):
    t0 = time.perf_counter()
    model = gpt(args)
    engine = zerompi.initialize(model, zerompi.ZeroConfig(stage=3, optimizer="adamw", dtype="fp32", lr=1e-4,
                                                          checkpoint_layout=args.layout))

    def step(i: int) -> float:
        x, y = batch(args, rank, i)
        engine.backward(engine(x, y)[1])
        engine.step()
        return 0.0
    step(0)  # the optimizer state exists from here on
    info = {"params": sum(p.numel() for p in model.parameters()),
            "largest_tensor": max(p.numel() for p in model.parameters()),
            "model_state_bytes": engine.stats.model_state_bytes, "setup_seconds": time.perf_counter() - t0}
    return engine, step, info


class Peer:
    """torch.distributed.checkpoint on FSDP2 (the peers benchmark's fully_shard setup) of the same GPT."""

    def __init__(self, args, comm):
        import run_fsdp  # benchmarks/peers
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        self.dcp, self.get, self.set, self.rank = dcp, get_state_dict, set_state_dict, comm.Get_rank()
        self.model = gpt(args)
        if comm.Get_rank() == 0:  # a free port: other jobs on this machine may use gloo's default one
            import socket
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        os.environ["MASTER_PORT"] = str(comm.bcast(port if comm.Get_rank() == 0 else None, root=0))
        opts = argparse.Namespace(variant="reshard", lr=1e-4, weight_decay=0.01)
        self.trainer = run_fsdp.build(self.model, opts, comm)
        self.opt = next(c.cell_contents for c in self.trainer.step.__closure__
                        if isinstance(c.cell_contents, torch.optim.Optimizer))
        self.args = args
        import torch.distributed as dist
        # DCP's background thread runs collectives: on a group of its own, not the one training uses
        # meanwhile (as torchtitan does), else the two threads' gloo messages mix
        self.group = dist.new_group(backend="gloo")
        self.step(0)

    def step(self, i: int) -> float:
        x, y = batch(self.args, self.rank, i)
        return self.trainer.step(x, y)

    def state(self) -> dict:
        model, optim = self.get(self.model, self.opt)
        return {"model": model, "optim": optim}

    def save(self, path: Path) -> None:
        self.dcp.save(self.state(), checkpoint_id=str(path))

    def load(self, path: Path) -> None:
        state = self.state()
        self.dcp.load(state, checkpoint_id=str(path))
        self.set(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def async_save(self, path: Path):
        return self.dcp.async_save(self.state(), checkpoint_id=str(path), process_group=self.group)


def _load(engine, root: Path, tag: str) -> None:
    if engine.load_checkpoint(root, tag) != {"tag": tag}:
        raise RuntimeError(f"load of {tag} returned another client_state")


def evict_all(comm, root: Path) -> float:
    """Rank 0 drops every file under ``root`` from the page cache; returns the share still resident."""
    files = files_under(root) if comm.Get_rank() == 0 else []
    if files:
        evict(files)
    return resident_fraction(files) if files else 0.0


def raw_rows(comm, timers, scratch: Path, nbytes: int, rep: int) -> dict:
    """Each rank writes (then fsyncs) and reads back cold its share of ``nbytes`` in every RAW_CONFIGS
    way, all ranks at once as in a save; the order turns by one each repeat."""
    path = scratch / f"raw-rank{comm.Get_rank()}.bin"
    per_rank = -(-nbytes // comm.Get_size() // 4096) * 4096  # O_DIRECT sizes are whole pages
    bufs = rawdisk.page_aligned(max(t for _, t, _ in RAW_CONFIGS), max(m for _, _, m in RAW_CONFIGS) << 20)
    turn = rep % len(RAW_CONFIGS)
    rows = {}
    for direct, threads, mib in RAW_CONFIGS[turn:] + RAW_CONFIGS[:turn]:
        how = (per_rank, direct, threads, mib << 20, bufs)
        write = timed_collective(comm, timers, lambda: raw_write(path, *how))
        evict([path])  # O_DIRECT writes leave no pages; buffered ones are dropped after their fsync
        read = timed_collective(comm, timers, lambda: raw_read(path, *how))
        path.unlink()
        rows[raw_name(direct, threads, mib)] = {"write": write, "read": read}
    for buf in bufs:
        buf.close()
    return {"raw": rows, "raw_bytes": per_rank * comm.Get_size()}


def async_rows(comm, timers, start, step, wait, first: int, steps: int) -> dict:
    """An asynchronous save: the call, ``steps`` training steps while it writes, then the wait."""
    call = timed_collective(comm, timers, start)
    during = [timed_collective(comm, timers, lambda i=i: step(first + i)) for i in range(steps)]
    done = timed_collective(comm, timers, wait)
    return {"call": call, "steps": during, "wait": done}


def zerompi_rows(comm, timers, engine, step, root: Path, rep: int, args) -> dict:
    tag, rows = f"sync{rep}", {}
    rows["save"] = timed_collective(comm, timers, lambda: engine.save_checkpoint(root, tag, {"tag": tag}))
    rows["resident_after_evict"] = evict_all(comm, root / tag)
    rows["load_cold"] = timed_collective(comm, timers, lambda: _load(engine, root, tag))
    rows["bytes"] = sum(p.stat().st_size for p in files_under(root / tag)) if comm.Get_rank() == 0 else 0
    for copy in (False, True):
        engine.config = engine.config.replace(checkpoint_async_copy=copy)  # read by each save from the config
        rows[f"step_{copy}"] = timed_collective(comm, timers, lambda: step(100 * rep + 10 * copy))
        name, waits = f"async{rep}{'c' * copy}", engine._fence.waited_s
        rows[f"async_{copy}"] = async_rows(
            comm, timers, lambda: engine.save_checkpoint(root, name, {"tag": name}, async_save=True) and None,
            step, engine.wait_checkpoint, 100 * rep + 10 * copy + 1, args.overlap_steps)
        rows[f"async_{copy}"]["fence_wait"] = comm.gather(engine._fence.waited_s - waits, root=0)
    return rows


def peer_rows(comm, timers, peer: Peer, root: Path, rep: int, args) -> dict:
    rows, path = {}, root / f"dcp-sync{rep}"
    rows["save"] = timed_collective(comm, timers, lambda: peer.save(path))
    rows["bytes"] = sum(p.stat().st_size for p in files_under(path)) if comm.Get_rank() == 0 else 0
    rows["resident_after_evict"] = evict_all(comm, path)
    rows["load_cold"] = timed_collective(comm, timers, lambda: peer.load(path))
    rows["step"] = timed_collective(comm, timers, lambda: peer.step(100 * rep))
    pending = []
    rows["async"] = async_rows(comm, timers, lambda: pending.append(peer.async_save(root / f"dcp-async{rep}")),
                               peer.step, lambda: pending.pop().result() and None, 100 * rep + 1, args.overlap_steps)
    return rows


def clean(comm, root: Path) -> None:
    comm.Barrier()
    if comm.Get_rank() == 0:
        for p in root.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
    comm.Barrier()


def run(args, comm, engine, step, peer, timers: Timers) -> list[dict]:
    root, reps = Path(args.root), []
    root.mkdir(parents=True, exist_ok=True)
    for rep in range(args.repeats):  # every row once per repeat: load on the machine hits them alike
        row = {"rep": rep, "load": os.getloadavg()[0], "zerompi": zerompi_rows(comm, timers, engine, step, root, rep, args)}
        nbytes = comm.bcast(row["zerompi"]["bytes"], root=0)
        row.update(raw_rows(comm, timers, root, nbytes, rep))
        if peer is not None:
            row["dcp"] = peer_rows(comm, timers, peer, root, rep, args)
        reps.append(row)
        if comm.Get_rank() == 0:
            z = row["zerompi"]
            raw = {k: min(max(r["seconds"] for r in v[k]) for v in row["raw"].values()) for k in ("write", "read")}
            log.info("rep %d: save %.2f s, cold load %.2f s, async call %.3f s, fastest raw write %.2f s, read %.2f s",
                     rep, max(r["seconds"] for r in z["save"]), max(r["seconds"] for r in z["load_cold"]),
                     max(r["seconds"] for r in z["async_False"]["call"]), raw["write"], raw["read"])
        clean(comm, root)
    return reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="checkpoint root to write")
    p.add_argument("--out", required=True, help="JSON results (rank 0)")
    for name, default in (("repeats", 3), ("n-layer", 12), ("n-embd", 1024), ("n-head", 16), ("block", 64),
                          ("overlap-steps", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--layout", default="auto", help="checkpoint_layout: auto, per_rank or shared")
    p.add_argument("--no-peer", action="store_true", help="skip the torch.distributed.checkpoint rows")
    args = p.parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    logging.basicConfig(level=logging.INFO if comm.Get_rank() == 0 else logging.WARNING,
                        format=f"[{comm.Get_size()} ranks] %(message)s")
    engine, step, info = build_engine(args, comm.Get_rank())
    peer = None if args.no_peer else Peer(args, comm)
    log.info("%d parameters, set up and one step in %.1f s", info["params"], info["setup_seconds"])
    timers = Timers()
    instrument(timers)
    reps = run(args, comm, engine, step, peer, timers)
    if comm.Get_rank() == 0:
        import zerompi.checksum
        Path(args.out).write_text(json.dumps({"world_size": comm.Get_size(), **info, "reps": reps,
                                              "crc32": zerompi.checksum.crc32.__module__}))
    engine.close()


if __name__ == "__main__":
    main()
