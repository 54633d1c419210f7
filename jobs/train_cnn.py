"""A small CNN classifying scikit-learn's 8x8 handwritten digits, ZeRO data-parallel over MPI.

    mpiexec -n 2 python -m mpi4py jobs/train_cnn.py [--config jobs/configs/cnn.toml] [--stage 0-3]

The 1,797 digits ship with scikit-learn (``load_digits``, no download; the
``examples`` extra installs it). A seeded split keeps test_fraction of them for
testing. Each optimizer step takes one global batch of an epoch-seeded permutation
of the training set, and each rank its own share of it (like torch's
DistributedSampler). BatchNorm normalises with each rank's own micro-batch
statistics, and rank 0's running statistics are broadcast before every forward,
as DDP does (common.broadcast_buffers). Rank 0 writes loss, accuracy, test loss and
test accuracy to metrics.jsonl and prints the final test accuracy.
"""
from __future__ import annotations

import torch
from torch import nn

import zerompi
from common import (LOOP_DEFAULTS, Preemption, apply_flags, broadcast_buffers, generator, job_main, load_config,
                    parse_args, setup_logging, shard_indices, share, start_run, test_metrics, train_loop)

TRAIN_DEFAULTS = dict(LOOP_DEFAULTS, batch=64, test_fraction=0.2, out_dir="out/cnn")
MODEL_DEFAULTS = dict(channels=16, hidden=64, dropout=0.25)


class DigitsCNN(nn.Module):
    """Two conv-BatchNorm-ReLU blocks, max pooling, dropout and a two-layer head: 8x8 -> 10 classes."""

    def __init__(self, channels: int = 16, hidden: int = 64, dropout: float = 0.25):
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.MaxPool2d(2))                                     # 2c x 4 x 4
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * c * 16, hidden), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_digits(test_fraction: float, seed: int):
    """(x_train, y_train, x_test, y_test): images as (N, 1, 8, 8) floats in [0, 1]."""
    from sklearn.datasets import load_digits as sk_load_digits
    digits = sk_load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=generator(seed, 0xD161))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def classify(engine, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy and the number of correct predictions."""
    logits = engine(x)
    return nn.functional.cross_entropy(logits, y), int((logits.argmax(1) == y).sum())


def evaluate(engine, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Test loss and accuracy over the whole test set, each rank scoring every world-th example."""
    world = engine.world_size
    broadcast_buffers(engine.module)
    engine.eval()
    with torch.no_grad():
        loss, correct = classify(engine, x[engine.rank::world], y[engine.rank::world])
    engine.train()
    return test_metrics(engine, len(x[engine.rank::world]), loss.item(), correct)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, "jobs/configs/cnn.toml", argv)
    preemption = Preemption()
    rank0 = setup_logging()
    model_doc, train, zero_doc = load_config(args.config, TRAIN_DEFAULTS)
    cfg = apply_flags(args, train, zero_doc)
    x, y, x_test, y_test = load_digits(train["test_fraction"], train["seed"])

    torch.manual_seed(train["seed"])
    model = DigitsCNN(**dict(MODEL_DEFAULTS, **model_doc))
    engine = zerompi.initialize(model, cfg)
    run = start_run(engine, train, {"model": dict(MODEL_DEFAULTS, **model_doc)}, args.resume, "samples",
                    train["batch"], preemption)

    def step_fn(step: int) -> dict:
        idx = shard_indices(len(x), train["batch"], step, train["seed"], engine.rank, engine.world_size)
        broadcast_buffers(engine.module)
        loss, correct = classify(engine, x[idx], y[idx])
        weight = share(len(idx), train["batch"], engine.world_size)  # the global batch's mean, also uneven
        engine.backward(loss * weight)
        engine.step()
        return {"loss": loss.item() * weight, "accuracy": correct / len(idx) * weight}

    result = train_loop(run, step_fn, lambda: evaluate(engine, x_test, y_test))
    if result.completed and rank0 and "val_accuracy" in result.metrics:
        print(f"test accuracy {result.metrics['val_accuracy']:.4f} on {len(x_test)} digits", flush=True)


if __name__ == "__main__":
    job_main(main)
