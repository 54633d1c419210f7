"""What the GPU workers share on top of tests/mpi/workers/common.py.

The engine trains on the device; the single-process reference and its
reordered runs (the order noise of tests/mpi/tolerance.py) train on the same
device in rank 0's process, so the bound follows that device's kernels, not
the CPU's. Results come back as CPU tensors, ready for ``compare``.

``--device cpu`` runs the same logic without a GPU: it only checks that a
worker runs end to end (the tests always pass ``cuda``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "mpi" / "workers"))

import torch  # noqa: E402

import zerompi  # noqa: E402
from common import Run, reference_orders, reference_train, tiny_gpt  # noqa: E402


def parser(doc: str, steps: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of the worker's logic on a machine without a GPU")
    if steps:
        p.add_argument("--steps", type=int, default=3)
    return p


def setup(device: str) -> torch.device:
    """The device of this process's reference runs; fp32 matmuls stay fp32 (no TF32), for the
    engine and the reference alike, whatever the environment asks."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch.cuda.is_available() is False")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on(device: torch.device, batches):
    """``batches`` ([step][micro] -> (x, y)) moved to ``device``."""
    return [[tuple(t.to(device) for t in b) for b in micro] for micro in batches]


def cpu_run(run: Run) -> Run:
    return Run({n: p.detach().cpu() for n, p in run.params.items()}, run.losses)


def references(cfg: zerompi.ZeroConfig, batches, world: int, device: torch.device,
               seed: int = 1) -> tuple[Run, list[Run]]:
    """The reference and its reordered runs, trained on ``device``, returned on the CPU."""
    dev = on(device, batches)
    ref = reference_train(tiny_gpt(seed).to(device), cfg, dev)
    alts = reference_orders(lambda: tiny_gpt(seed).to(device), cfg, dev, world)
    return cpu_run(ref), [cpu_run(a) for a in alts]


def devices(tensors) -> list[str]:
    """The device types ``tensors`` live on, e.g. ['cuda'] (storage-less swapped tensors count too)."""
    return sorted({t.device.type for t in tensors})


def placement(engine) -> dict:
    """Where the engine keeps what: compute parameters, fp32 masters, optimizer state."""
    buckets = engine.sharded.buckets
    state = [v for st in engine.optimizer.inner.state.values() for v in st.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return dict(params=devices(engine.module.parameters()), masters=devices(b.master for b in buckets),
                state=devices(state), cuda_aware=engine.group.cuda_aware)
