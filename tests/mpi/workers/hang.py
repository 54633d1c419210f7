"""Hang worker: the last rank (--culprit) misbehaves at step --at; the hang report must name it.

Stage 3, one tiny bucket per module, hang_floor=--floor seconds, records in --records (default
--dir). Before the
fault the culprit writes the wall time to DIR/fault.time. Faults (--fault):

extra_microbatch  one forward/backward more before step()
skip_module       its forward skips the module 'mid'
save_alone        calls save_checkpoint alone
loader_sleep      sleeps in its data loader (load_batch)
busy_loop         loops forever in user code (spin)
sigkill           SIGKILLs itself (MPICH's mpiexec then ends the job: no hang)
sigstop           SIGSTOPs itself: a rank that cannot answer (as a killed one under a launcher
                  that leaves the others running)
raise             raises in user code (RuntimeError)
user_barrier      waits in a user's Barrier on its own communicator that no other rank enters
branch            data-dependent control flow: its batch takes the branch without 'mid'
step_early        calls step() without backward, while the others are in backward
bucket_size       built with another bucket_mb (initialize names the key and every rank's value)
oom               a tensor too large for memory in its forward (the allocator raises)
none              no fault: the job must end normally
"""
import argparse
import os
import signal
import sys
import time

import torch
from mpi4py import MPI
from torch import nn

import zerompi

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
USER = COMM.Dup()  # a communicator of the user's own, outside zerompi


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # equal sizes: a skipped module leaves collectives MPI cannot tell apart (no truncation error)
        self.fc1, self.mid, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.skip_mid = False
        self.oom = False

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.oom:
            torch.empty(2**62, dtype=torch.uint8)  # no machine has this: the allocator raises
        if not self.skip_mid and x.abs().max() < 100:  # a batch of huge values takes the short branch
            h = self.mid(h)
        return self.fc2(h).pow(2).mean()


def load_batch(fault, culprit):
    if culprit and fault == "loader_sleep":
        time.sleep(600)
    x = torch.randn(4, 8)
    return x * 1000 if culprit and fault == "branch" else x


def spin():
    n = 0
    while True:
        n += 1


def mark_fault(directory):
    with open(os.path.join(directory, "fault.time"), "w") as f:
        f.write(repr(time.time()))


def train_step(engine, model, fault, culprit, directory):
    x = load_batch(fault, culprit)
    if culprit:
        if fault == "busy_loop":
            spin()
        if fault in ("sigkill", "sigstop"):
            os.kill(os.getpid(), signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
        if fault == "raise":
            raise RuntimeError("boom in user code")
        if fault == "user_barrier":
            USER.Barrier()
        if fault == "save_alone":
            engine.save_checkpoint(os.path.join(directory, "ckpt"), "alone")
        model.skip_mid = fault == "skip_module"
        model.oom = fault == "oom"
    loss = engine(x)
    if culprit and fault == "step_early":
        return engine.step()
    engine.backward(loss)
    if culprit and fault == "extra_microbatch":
        engine.backward(engine(load_batch(fault, culprit)))
    return engine.step()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fault", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--records", default=None, help="hang_dir (default: --dir)")
    p.add_argument("--at", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--floor", type=float, default=2.0)
    p.add_argument("--culprit", type=int, default=WORLD - 1)
    p.add_argument("--no-close", action="store_true", help="leave the engine open at exit")
    p.add_argument("--progress", default="none", help="mpi_progress")
    args = p.parse_args()
    bucket = 1e-3 if args.fault == "bucket_size" and RANK == args.culprit else 1e-4
    cfg = zerompi.ZeroConfig(stage=3, bucket_mb=bucket, optimizer="sgd", lr=0.1, hang_floor=args.floor,
                             hang_dir=args.records or args.dir, mpi_progress=args.progress,
                             overlap_grad_reduce=args.progress != "none", prefetch_units=int(args.progress != "none"))
    model = Net()
    if args.fault == "bucket_size" and RANK == args.culprit:
        mark_fault(args.dir)  # its buckets differ from the start
    engine = zerompi.initialize(model, cfg)
    for i in range(args.steps):
        culprit = RANK == args.culprit and i == args.at
        if culprit:
            mark_fault(args.dir)
        train_step(engine, model, args.fault, culprit, args.dir)
    COMM.Barrier()
    if RANK == 0:
        print("no hang", flush=True)
    if not args.no_close:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
