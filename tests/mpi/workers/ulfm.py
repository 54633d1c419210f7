"""fault_tolerance=True worker: train G micro-batches a step while chosen ranks SIGKILL themselves.

``--kill RANK:PHASE:STEP`` (repeatable, comma-separated) makes world rank RANK kill itself with
SIGKILL in PHASE (forward, backward, end_backward, step, recovery_save, save, async_save or
full_state_dict) of optimizer step STEP (0-based), or raise an uncaught RuntimeError in its forward (PHASE
``raise``): mid-forward (between two layers), mid-backward (from a
gradient hook), between its autograd backward and ``end_backward`` (``--halves``: the loop runs
``begin_backward``, the autograd backward and ``end_backward`` itself, as the DeepSpeed engine does),
inside the optimizer's step, while taking the recovery point step() keeps (in memory, or its shard file
with ``--source disk``), while writing its shard file of the checkpoint the loop saves after step
``--save-at``, or before the ``full_state_dict()`` the loop then takes (``--consolidate``). The survivors
recover (zerompi.Recovered) and finish; rank 0 of the final group writes the SHA-256 of the
parameters, fp32 masters and optimizer state, the final world size and the recovery reports.
``--muon`` trains the matrices with torch.optim.Muon (owner ranks, whole tensors), the rest with AdamW;
``--adafactor`` every tensor with torch.optim.Adafactor (its factored state is saved per tensor).
``--remove-points`` has rank 0 delete the recovery points (``--source disk``) in the step a rank dies, so
the recovery itself fails. ``--ft off`` trains the same without fault tolerance (the failure-free reference);
``--failure-free '[[N, [ARGS...]], ...]'`` trains each ARGS so, on the first N ranks, one after another in
one job, and rank 0 writes each run's report in order. ``--reproducible off``
trains without reproducible=True (summed in MPI's order) and writes the state itself too, to be judged
against the failure-free run within summation-order noise. ``--pause-after K --started FILE --go FILE``:
after step K rank 0 writes FILE ``--started`` and every rank waits (at most PAUSE_LIMIT s) until FILE ``--go``
exists, so that a test can kill a whole node while the ranks wait (tests/mpi/test_cluster_ulfm.py).
"""
import argparse
import faulthandler
import json
import os
import shutil
import signal
import tempfile
import time

import torch
from mpi4py import MPI
from torch import nn

import zerompi
import zerompi.checkpoint.replica as replica
import zerompi.checkpoint.writer as writer
from zerompi.checkpoint.stores import PerRankStore
from zerompi.optim.optimizer import ZeroOptimizer
from common import say_fault, state_digest, state_items, write_json

G, STEPS = 6, 4
PAUSE_LIMIT = 300.0  # seconds the ranks wait for --go
WORLD_RANK = MPI.COMM_WORLD.Get_rank()


class Now:
    step, phase = 0, ""
    kills: set = set()
    async_dies = False  # this rank dies in the background write of the asynchronous save it starts
    remove_points = None  # --remove-points: the recovery directory rank 0 deletes in the step of a kill


def maybe_die(phase: str) -> None:
    if (WORLD_RANK, phase, Now.step) in Now.kills:
        os.kill(os.getpid(), signal.SIGKILL)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 48), nn.LayerNorm(48), nn.GELU(), nn.Dropout(0.2))
        self.b = nn.Sequential(nn.Linear(48, 40), nn.Tanh(), nn.Dropout(0.1), nn.Linear(40, 4))

    def forward(self, x):
        h = self.a(x)
        if Now.phase == "forward":
            maybe_die("forward")
            if (WORLD_RANK, "raise", Now.step) in Now.kills:
                raise RuntimeError(f"world rank {WORLD_RANK} raises in step {Now.step}")
        if h.requires_grad:
            h.register_hook(lambda g: maybe_die("backward") if Now.phase == "backward" else None)
        return self.b(h)


_step, _write, _take = ZeroOptimizer.step, writer._write_shards, replica.take


def _dying_step(self, *a, **k):
    if Now.remove_points is not None and WORLD_RANK == 0 and any(s == Now.step for _, _, s in Now.kills):
        shutil.rmtree(Now.remove_points)  # before the lost rank's peers notice: the recovery finds nothing
        say_fault()  # the test's clock starts here
    maybe_die("step")
    return _step(self, *a, **k)


def _dying_write(*a, **k):
    if Now.phase == "save":
        maybe_die("save")
    elif Now.phase == "step":  # the recovery checkpoint step() saves after the update
        maybe_die("recovery_save")
    return _write(*a, **k)


def _dying_take(*a, **k):
    if Now.phase == "step":  # the recovery point step() takes in memory after the update
        maybe_die("recovery_save")
    return _take(*a, **k)


_store_write = PerRankStore.write


def _dying_store_write(*a, **k):
    if Now.async_dies:  # on the save's own thread, while the next step runs
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    return _store_write(*a, **k)


ZeroOptimizer.step, writer._write_shards, replica.take = _dying_step, _dying_write, _dying_take
PerRankStore.write = _dying_store_write


def batch(step: int, index: int):
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)




def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--ft", default="on")
    p.add_argument("--kill", default="")
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--recovery-every", type=int, default=1)
    p.add_argument("--min-ranks", type=int, default=1)
    p.add_argument("--collective-timeout", type=float, default=None)
    p.add_argument("--reproducible", default="on")
    p.add_argument("--source", default="memory", help="recovery_source")
    p.add_argument("--offload", default="none", help="offload_optimizer and offload_params")
    p.add_argument("--async-save", action="store_true", help="the loop's checkpoint is saved asynchronously")
    p.add_argument("--hsdp", action="store_true", help="hierarchy='hsdp' over emulated nodes of two ranks")
    p.add_argument("--halves", action="store_true", help="backward as begin_backward, autograd, end_backward")
    p.add_argument("--consolidate", action="store_true", help="full_state_dict() after step --save-at")
    p.add_argument("--muon", action="store_true", help="torch.optim.Muon on the matrices (whole tensors on owners)")
    p.add_argument("--adafactor", action="store_true", help="torch.optim.Adafactor on every tensor (whole tensors)")
    p.add_argument("--remove-points", action="store_true",
                   help="recovery points on disk (give --source disk), which rank 0 deletes in the step a rank dies")
    p.add_argument("--pause-after", type=int, default=-1)
    p.add_argument("--started")
    p.add_argument("--go")
    p.add_argument("--failure-free", default="",
                   help="JSON [[N, [ARGS...]], ...]: train each without fault tolerance on the first N ranks, in turn")
    return p.parse_args(argv)


def train(a: argparse.Namespace, comm) -> dict:
    """Train as ``a`` says over ``comm``; what rank 0 of the final group reports (None elsewhere)."""
    Now.kills = {(int(r), ph, int(s)) for r, ph, s in (k.split(":") for k in a.kill.split(",") if k)}
    torch.manual_seed(0)
    points = comm.bcast(tempfile.mkdtemp(prefix="zerompi-ulfm-points-") if comm.Get_rank() == 0 else None)
    Now.remove_points = points if a.remove_points else None
    cfg = zerompi.ZeroConfig(stage=a.stage, lr=3e-2, weight_decay=0.1, clip_grad_norm=0.05, recovery_dir=points,
                             reproducible=a.reproducible == "on",
                             micro_batches=G, cpu_threads=1, device="cpu", bucket_mb=700 * 4 / 2**20,
                             checkpoint_layout="per_rank", fault_tolerance=a.ft == "on",
                             recovery_every=a.recovery_every, min_ranks=a.min_ranks, recovery_source=a.source,
                             collective_timeout=a.collective_timeout, offload_optimizer=a.offload,
                             offload_params=a.offload if a.stage == 3 else "none",
                             hierarchy="hsdp" if a.hsdp else "flat", ranks_per_node=2 if a.hsdp else None,
                             optimizer="torch.optim.Adafactor" if a.adafactor else "adamw")
    net = Net()
    groups = [{"params": [p for p in net.parameters() if p.dim() == 2], "optimizer": torch.optim.Muon},
              {"params": [p for p in net.parameters() if p.dim() != 2]}] if a.muon else None
    hosts = comm.allgather(MPI.Get_processor_name())
    engine = zerompi.initialize(net, cfg, comm=comm, param_groups=groups)
    ckpt = engine.group.allgather_object(tempfile.mkdtemp(prefix="zerompi-ulfm-") if engine.rank == 0 else None)[0]
    reports, started = [], time.perf_counter()
    while engine.stats.steps < a.steps:
        try:
            Now.step = engine.stats.steps
            for i in engine.micro_batch_indices():
                x, y = batch(Now.step, i)
                Now.phase = "forward"
                out = engine(x)
                Now.phase = "backward"
                loss = ((out - y) ** 2).mean()
                if a.halves:
                    factor = engine.begin_backward()
                    (loss * factor).backward()
                    maybe_die("end_backward")
                    engine.end_backward(ok=True)
                else:
                    engine.backward(loss)
            Now.phase = "step"
            engine.step()
            if engine.stats.steps == a.save_at and a.consolidate:
                Now.phase = "full_state_dict"
                maybe_die("full_state_dict")
                engine.full_state_dict()
            if engine.stats.steps == a.save_at:
                Now.phase = "save"
                Now.async_dies = a.async_save and (WORLD_RANK, "async_save", Now.step) in Now.kills
                engine.save_checkpoint(ckpt, tag="user", async_save=a.async_save)
            Now.phase = ""
            if engine.stats.steps - 1 == a.pause_after and not reports:
                pause(a, engine.rank)
        except zerompi.Recovered as r:
            reports.append(dict(r.report.__dict__))
    seconds = time.perf_counter() - started
    out = dict(digest=state_digest(engine), world=engine.world_size, reports=reports, seconds=seconds,
               steps=engine.stats.steps, indices=engine.micro_batch_indices(), hosts=hosts)
    if a.reproducible == "off":
        out["state"] = {label: data.tolist() for label, data in state_items(engine) if not isinstance(data, str)}
    engine.close()
    return out if engine.rank == 0 else None


def pause(a: argparse.Namespace, rank: int) -> None:
    """Say the job is past step --pause-after (rank 0) and wait for the test's --go."""
    if rank == 0:
        with open(a.started, "w") as f:
            f.write(f"{time.time()}\n")
    deadline = time.monotonic() + PAUSE_LIMIT
    while not os.path.exists(a.go) and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a test's timeout asks for every thread's stack
    a = parse()
    if not a.failure_free:
        out = train(a, MPI.COMM_WORLD)
        if out is not None:
            write_json(a.out, out)
        return
    runs = []  # the failure-free runs in turn, each on a communicator of the first N ranks
    for n, args in json.loads(a.failure_free):
        comm = MPI.COMM_WORLD.Split(0 if WORLD_RANK < n else MPI.UNDEFINED, WORLD_RANK)
        if comm != MPI.COMM_NULL:
            runs.append(train(parse(["--out", a.out, *args, "--ft", "off"]), comm))
            comm.Free()
    if WORLD_RANK == 0:
        write_json(a.out, dict(runs=runs))


if __name__ == "__main__":
    main()
