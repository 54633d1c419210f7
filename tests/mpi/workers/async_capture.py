"""An asynchronous save holds every item it captures as it was at the call, not as the next steps leave it.

Each case trains two steps, records what the save captures (error-feedback residuals, the fp16 loss
scaler, the lr scheduler, the CPU RNG, the step counters, the data position passed as client_state),
saves with async_save=True, then trains two more steps that change every one of them (a scale that
grows each step, a scheduler keeping a list it appends to, RNG draws, the position dict advanced in
place as each batch is taken) before waiting. The save's taking of each bucket is slowed
(--slow-capture), so the first step after the call waits at the fence: its position change and
backward pass (new residuals) come before the writer takes a bucket, its scaler and scheduler
updates as it takes the last, while the writer still has its file to finish and fsync and rank 0
the index to write. A fresh engine (other initial values) then loads the checkpoint, and each rank
reports, per item, whether what came back is bitwise what was recorded at the call.
Rank 0 writes the rows to OUT (JSON); tests/mpi/test_checkpoint.py judges them.
"""
import argparse
import json

import torch
from mpi4py import MPI

import zerompi
from common import gpt_loss, local_part, slow_capture, tiny_gpt, token_batches, write_json

COMM = MPI.COMM_WORLD
world, rank = COMM.Get_size(), COMM.Get_rank()


class Tracked(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler whose state holds a list it appends to in place (its state_dict shares it)."""

    def __init__(self, optimizer):
        self.seen: list[float] = []
        super().__init__(optimizer, lambda k: 1.0 / (k + 1))

    def step(self, *args, **kwargs):
        super().step(*args, **kwargs)
        self.seen.append(self.get_last_lr()[0])


def state(engine, position: dict) -> dict:
    """Every item the save captures, as copies."""
    return dict(residuals=[r.detach().clone() for _, r in engine.sharded.residuals()],
                scaler=engine.optimizer.scaler_state(), steps=engine.stats.steps,
                scheduler=json.dumps(engine.lr_scheduler.state_dict(), sort_keys=True),
                rng=torch.get_rng_state(), position=json.loads(json.dumps(position)))


def equal(a, b) -> bool:
    """Bitwise for tensors (and lists of them), == for the rest."""
    if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return bool(torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b


def train(engine, batches, position: dict) -> None:
    for (batch,) in batches:
        position["next_step"] += 1  # the data position, advanced in place as the batch is taken
        torch.rand(7)  # the data pipeline's draws move the RNG on
        engine.backward(gpt_loss(engine, local_part(batch, rank)))
        engine.step()


def case(name: str, root: str, slow: float, **kw) -> dict:
    cfg = zerompi.ZeroConfig(bucket_mb=0.004, optimizer="adamw", lr=1e-2, cpu_threads=1, abort_on_exception=False,
                             quantize_grads="int4", grad_error_feedback=True, dtype="fp16", loss_scale_window=1,
                             checkpoint_layout="per_rank", **kw)
    batches = token_batches(7, world, 4, 1)
    engine = zerompi.initialize(tiny_gpt(seed=1), cfg, lr_scheduler=Tracked)
    position = {"epoch": 0, "next_step": 0}
    train(engine, batches[:2], position)
    torch.manual_seed(100 + rank)
    at_call = state(engine, position)
    slow_capture(engine, slow)
    engine.save_checkpoint(root, tag="mid", client_state=position, async_save=True)
    train(engine, batches[2:], position)  # while the save writes
    later = state(engine, position)
    waits = engine._fence.waits
    engine.wait_checkpoint()
    engine.close()
    fresh = zerompi.initialize(tiny_gpt(seed=2), cfg, lr_scheduler=Tracked)
    torch.manual_seed(999)
    returned = fresh.load_checkpoint(root, tag="mid")
    loaded = state(fresh, returned)
    fresh.close()
    same = {k: equal(at_call[k], loaded[k]) for k in at_call}
    moved = {k: not equal(at_call[k], later[k]) for k in at_call}
    return dict(case=name, rank=rank, same=same, moved=moved, fence_waits=waits)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True, help="the checkpoints go under ROOT/<case>")
    p.add_argument("--slow-capture", type=float, default=0.2)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for stage in (3, 1):
        rows += COMM.gather(case(f"s{stage}", f"{args.root}/s{stage}", args.slow_capture, stage=stage)) or []
    if rank == 0:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
