"""A Lightning training run as users write it (a LightningModule, ``configure_optimizers`` with param groups
and a per-step lr scheduler, a Trainer), for tests/mpi/test_lightning.py.

``--plain``: the reference, one plain process and a torch loop over the same global batches (each step's
rows as ``--chunks`` chunks whose mean losses are averaged, rows reversed with ``--reverse``): what the
engine's ranks must reproduce up to summation order. Otherwise, under ``mpiexec``:
``Trainer(strategy=ZeroMPIStrategy(ZeroConfig(stage=S)))`` with the sampler Lightning gives every rank,
``--save-dir`` writing a checkpoint after each epoch's last step (ModelCheckpoint) and ``--resume`` continuing one.
Rank 0 writes the per-step mean losses over the global batch and the final weights as JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn

import lightning as L
from lightning.fabric.plugins import TorchCheckpointIO

IN, HIDDEN, OUT = 8, 16, 4


def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 2.0) + 0.1 * torch.randn(n, OUT, generator=g)


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 1e-2):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.LayerNorm(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
        self.register_buffer("target_scale", torch.tensor(1.5))
        self.lr = lr
        self.seen: list[float] = []

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y * self.target_scale)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.seen.append(loss.detach().item())
        self.log("train_loss", loss, sync_dist=True)  # the strategy's reduce, every step
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=self.lr,
                                betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def plain(a) -> dict:
    """One process, a torch loop: each step's global batch (the rows every rank's sampler gives it for the
    step) as ``chunks`` equal chunks."""
    torch.set_num_threads(1)
    module = Tiny()
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    global_batch = a.world * a.micro * a.accum
    x, y = rows(a.steps_per_epoch * global_batch)
    losses = []
    for step in range(a.steps):
        # Lightning's DistributedSampler: the epoch's permutation (seed 0 + epoch), rank r taking its
        # positions r, r + W, ...: one step's micro-batches on every rank are one block of it
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(step // a.steps_per_epoch))
        at = (step % a.steps_per_epoch) * global_batch
        block = perm[at:at + global_batch]
        bx, by = x[block], y[block]
        if a.reverse:
            bx, by = bx.flip(0), by.flip(0)
        opt.zero_grad()
        total = 0.0
        for cx, cy in zip(bx.chunk(a.chunks), by.chunk(a.chunks)):
            loss = module.loss((cx, cy))
            (loss / a.chunks).backward()
            total += loss.item()
        losses.append(total / a.chunks)
        torch.nn.utils.clip_grad_norm_(module.parameters(), a.clip)
        opt.step()
        sched.step()
    return {"losses": losses, "weights": {k: v.tolist() for k, v in module.state_dict().items()}}


class SlowOnRankZero(TorchCheckpointIO):
    """Lightning's checkpoint writer, a second late on rank 0 (a slow shared file system)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
            time.sleep(1.0)
        super().save_checkpoint(checkpoint, path, storage_options)


def distributed(a) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from zerompi import ZeroConfig
    from zerompi.compat.lightning import ZeroMPIStrategy

    strategy = ZeroMPIStrategy(ZeroConfig(stage=a.stage, cpu_threads=1))
    world = strategy.world_size
    x, y = rows(a.steps_per_epoch * world * a.micro * a.accum)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=a.micro)
    # saved after the batch that ends a window (every_n_train_steps): from a save at on_train_epoch_end Lightning
    # 2.6 replays one batch of the finished epoch on resume, plain Lightning included
    callbacks = [ModelCheckpoint(dirpath=a.save_dir, every_n_train_steps=a.steps_per_epoch, save_top_k=-1)
                 ] if a.save_dir else []
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=a.steps,
                        accumulate_grad_batches=a.accum, gradient_clip_val=a.clip, logger=False,
                        enable_checkpointing=bool(a.save_dir), callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    module = Tiny()
    trainer.fit(module, loader, ckpt_path=a.resume)
    seen = strategy.all_gather(torch.tensor(module.seen, dtype=torch.float64))  # (ranks, batches run here)
    per_step = seen.view(world, -1, a.accum).mean(dim=(0, 2))
    weights = strategy.lightning_module_state_dict()
    assert strategy.broadcast(strategy.global_rank, src=1 % world) == 1 % world
    # Lightning's rank-zero-only logging and files: rank 0's alone (its own guess reads RANK-style variables,
    # which mpiexec does not set)
    assert rank_zero_only.rank == strategy.global_rank, (rank_zero_only.rank, strategy.global_rank)
    if a.save_dir:  # a direct save returns on every rank once Lightning's state is written, slow as it may be
        strategy.checkpoint_io = SlowOnRankZero()
        direct = os.path.join(a.save_dir, "direct")
        strategy.save_checkpoint({"global_step": trainer.global_step}, direct)
        assert os.path.isfile(os.path.join(direct, "lightning.ckpt")), f"rank {strategy.global_rank}: not yet"
    assert strategy.reduce(torch.tensor([2.0, float(strategy.global_rank)]), reduce_op="max").tolist() == \
        [2.0, float(world - 1)]
    return {"world": world, "global_step": trainer.global_step, "losses": per_step.tolist(),
            "weights": {k: v.tolist() for k, v in weights.items()},
            "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
            "rank": strategy.global_rank}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--world", type=int, default=2, help="--plain: the ranks whose global batch to train on")
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--reverse", action="store_true")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--steps-per-epoch", type=int, default=3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--save-dir")
    p.add_argument("--resume")
    a = p.parse_args()
    result = plain(a) if a.plain else distributed(a)
    if result.get("rank", 0) == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
