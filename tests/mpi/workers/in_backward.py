"""optimizer_in_backward worker: each bucket updated during backward, bit for bit as in step().

For stages 2-3, offload none/cpu/nvme, fp32/bf16, one or two micro-batches per
step and blocking or overlapped reduce-scatters, the tiny GPT trains twice, with
and without the option; rank 0 writes whether parameters, losses and gradient
norms are equal, and each run's swap traffic. Then the refusals: a save between
backward and step, and a NaN gradient (raised by step(), naming what was updated).
"""
import argparse
import os

import torch
from mpi4py import MPI

import zerompi
from common import engine_train, gpt_loss, local_part, tiny_gpt, token_batches, write_json

COMM = MPI.COMM_WORLD


def config(stage, dtype, mode, swap, in_backward, **extra):
    return zerompi.ZeroConfig(stage=stage, dtype=dtype, optimizer="adamw", lr=1e-2, weight_decay=0.1,
                              offload_optimizer=mode, offload_params=mode if stage == 3 else "none", nvme_path=swap,
                              optimizer_in_backward=in_backward, abort_on_exception=False,
                              **{"bucket_mb": 0.004, **extra})


def model(frozen: bool):
    m = tiny_gpt(1)
    if frozen:  # a frozen block: its buckets take no update, in backward or after
        for p in m.transformer.h[0].parameters():
            p.requires_grad_(False)
    return m


def train(stage, dtype, mode, swap, in_backward, batches, frozen, **extra):
    engine = zerompi.initialize(model(frozen), config(stage, dtype, mode, swap, in_backward, **extra))
    run = engine_train(engine, batches)
    stats = engine.stats
    out = dict(params=run.params, losses=run.losses, norm=stats.last_grad_norm,
               read=stats.swap_read_bytes, written=stats.swap_write_bytes)
    engine.close()
    return out


def compare(stage, dtype, mode, swap, batches, frozen=False, **extra):
    a = train(stage, dtype, mode, swap, False, batches, frozen, **extra)
    b = train(stage, dtype, mode, swap, True, batches, frozen, **extra)
    return dict(stage=stage, dtype=dtype, mode=mode, accum=len(batches[0]), frozen=frozen,
                overlap=extra.get("overlap_grad_reduce", False),
                params_equal=all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]),
                trained=a["losses"][0] != a["losses"][-1],
                losses=[a["losses"], b["losses"]], norms=[a["norm"], b["norm"]],
                traffic=[[a["read"], a["written"]], [b["read"], b["written"]]])


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises once armed (after the layers above it were updated)."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if FailingBackward.armed:
            raise RuntimeError("backward failed on purpose")
        return g


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(FailingBackward.apply(self.a(x))).pow(2).mean()


def abandoned(swap):
    """A backward that raises after some buckets were updated: they keep it, the writes land, and the
    engine trains on."""
    engine = zerompi.initialize(Stack(), config(2, "fp32", "nvme", swap, True, bucket_mb=4e-5))  # b, then a apart
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(engine.rank))
    out = {"buckets": len(engine.sharded.buckets)}
    before = engine.full_state_dict()
    FailingBackward.armed = True
    try:
        engine.backward(engine(x))
        out["error"] = "no error"
    except RuntimeError as e:
        out["error"] = str(e)
    FailingBackward.armed = False
    out["pending_after"] = engine.optimizer.updated_in_backward
    after = engine.full_state_dict()
    out["changed"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
    engine.backward(engine(x))
    out["stepped"] = engine.step()
    engine.close()
    return out


def refusals(swap, batches):
    engine = zerompi.initialize(tiny_gpt(1), config(3, "fp32", "nvme", swap, True))
    out = {}
    engine.backward(gpt_loss(engine, local_part(batches[0][0], engine.rank)))
    try:
        engine.save_checkpoint(os.path.join(swap, "never"))
        out["save"] = "no error"
    except zerompi.UsageError as e:
        out["save"] = str(e)
    engine.step()
    x, y = local_part(batches[1][0], engine.rank)
    loss = gpt_loss(engine, (x, y))
    engine.backward(loss * float("nan") if engine.rank == COMM.Get_size() - 1 else loss)
    try:
        engine.step()
        out["nan"] = "no error"
    except zerompi.ZeroMPIError as e:
        out["nan"] = str(e)
    engine.close()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--swap", required=True)
    args = p.parse_args()
    world = COMM.Get_size()
    one, two = token_batches(3, world, 3, 1), token_batches(4, world, 3, 2)
    rows = []
    for stage in (2, 3):
        for mode in ("none", "cpu", "nvme"):
            rows.append(compare(stage, "fp32", mode, args.swap, one))
        rows.append(compare(stage, "bf16", "nvme", args.swap, two))
        rows.append(compare(stage, "fp32", "nvme", args.swap, two, overlap_grad_reduce=True))
        rows.append(compare(stage, "bf16", "none", args.swap, one, frozen=True, overlap_grad_reduce=True))
    rows.append(compare(3, "fp32", "nvme", args.swap, one, frozen=True, prefetch_units=2))
    result = dict(rows=rows, refusals=refusals(args.swap, one), abandoned=abandoned(args.swap))
    COMM.Barrier()  # each rank's close() removes its own swap file: list once every rank has closed
    result["left_behind"] = sorted(os.listdir(args.swap))
    if COMM.Get_rank() == 0:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
