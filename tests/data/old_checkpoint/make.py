"""Write the old-format checkpoint that tests/unit/checkpoint/test_old_checkpoint.py loads.

Run at the commit being pinned, from the repository root (public API only, so any version runs it):

    mpiexec -n 2 .venv/bin/python -m mpi4py tests/data/old_checkpoint/make.py tests/data/old_checkpoint/<name>

It trains a tiny model at stage 3 on 2 ranks (a frozen first layer: frozen shards too) for two
steps, saves ``ckpt/step2`` and writes ``expected.json``: the steps taken and the SHA-256 of each
full fp32 parameter, which a load at any world size must give back bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch import nn

import zerompi


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    m[0].weight.requires_grad_(False)
    return m


def config() -> zerompi.ZeroConfig:
    return zerompi.ZeroConfig(stage=3, lr=0.05, bucket_mb=32 * 4 / 2**20, cpu_threads=1, device="cpu",
                              checkpoint_layout="per_rank", optimizer_kwargs={"foreach": False})


def digests(engine) -> dict[str, str]:
    return {n: hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()
            for n, t in engine.full_state_dict().items()}


def main(out: Path) -> None:
    engine = zerompi.initialize(model(), config())
    g = torch.Generator().manual_seed(1 + engine.rank)
    for _ in range(2):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
    engine.save_checkpoint(out / "ckpt", tag="step2", client_state={"epoch": 1})
    expected = {"steps": engine.stats.steps, "params": digests(engine), "client_state": {"epoch": 1}}
    if engine.rank == 0:
        (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    engine.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
