"""Reliability worker: one rank misbehaves; the job must end, or every rank must raise.

--case raise     rank N-1 raises at step 2 (run as plain `python`, not `-m mpi4py`)
--case sigkill   every rank writes its pid to --out.RANK and trains until killed
--case mismatch  debug_collectives on; rank N-1 skips a module (rank-dependent control flow)
--case watchdog  collective_timeout=3; rank N-1 sleeps 120 s before its backward
--case nan       rank N-1's loss is NaN at step 1; --nonfinite raise|skip
--cases SPEC     several of the cases that raise on every rank (mismatch, nan) in one job (workers/cases.py)
"""
import argparse
import os
import time

import torch
from mpi4py import MPI
from torch import nn

import cases
import zerompi
from common import say_fault, write_json

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
LAST = WORLD - 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.mid, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.skip_mid = False

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if not self.skip_mid:
            h = self.mid(h)
        return self.fc2(h).pow(2).mean()


def step(engine, model, i, args):
    x = torch.randn(4, 4)
    if args.case == "mismatch" and RANK == LAST:
        model.skip_mid = True
    loss = engine(x)
    if args.case == "raise" and RANK == LAST and i == 2:
        say_fault()
        raise RuntimeError("boom on purpose")
    if args.case == "watchdog" and RANK == LAST and i == 1:
        say_fault()
        time.sleep(120)
    if args.case == "nan" and RANK == LAST and i == 1:
        loss = loss * float("nan")
    engine.backward(loss)
    return engine.step()


def run(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--nonfinite", default="raise")
    args = p.parse_args(argv)
    cfg = zerompi.ZeroConfig(stage=3, bucket_mb=1e-4, optimizer="sgd", lr=0.1, nonfinite=args.nonfinite,
                             debug_collectives=args.case == "mismatch",
                             collective_timeout=3.0 if args.case == "watchdog" else None)
    model = Net()
    engine = zerompi.initialize(model, cfg)
    if args.case == "sigkill":
        with open(f"{args.out}.{RANK}", "w") as f:
            f.write(str(os.getpid()))
    result = {}
    try:
        before = engine.full_state_dict() if args.case == "nan" else None
        for i in range(10**6 if args.case == "sigkill" else 4):
            stepped = step(engine, model, i, args)
            if args.case == "nan" and i == 1:
                after = engine.full_state_dict()
                result["stepped_at_nan"] = stepped
                result["unchanged"] = all(torch.equal(before[n], after[n]) for n in before) if i == 1 else None
            if args.case == "nan" and i == 0:
                before = engine.full_state_dict()
        result["error"] = "no error"
    except zerompi.ZeroMPIError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["skipped"] = engine.stats.skipped_steps
    engine.close()
    rows = COMM.allgather(result)
    if RANK == 0:
        write_json(args.out, rows)


if __name__ == "__main__":
    cases.main(run)
