"""reproducible=True worker: one SHA-256 of the trained state, the same at every world size.

A small model with dropout and LayerNorm (in the "frozen" rows with a frozen first layer, in the "lora"
rows as peft's LoRA over a frozen base) trains
STEPS steps on G = 6 micro-batches per step, whose data comes from (step, global index) alone, with
gradient clipping that bites. For stages 0-3, fp32/bf16, offload none/cpu (and two NVMe rows), rank
0 writes the SHA-256 of the parameters, masters, optimizer state and gradient norms after each step. ``--save-after K --ckpt D``
saves after K steps and stops; ``--resume D`` loads D and trains the remaining steps.
"""
import argparse
import struct
import tempfile

import torch
from mpi4py import MPI
from torch import nn

import zerompi
from common import state_digest, write_json

COMM = MPI.COMM_WORLD
G, STEPS = 6, 3
ROWS = [(stage, dtype, offload, frozen) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")
        for offload, frozen in (("none", False), ("none" if stage == 0 else "cpu", True))]  # stage 0: no offload
ROWS += [(2, "fp32", "nvme", False), (3, "bf16", "nvme", True), (1, "fp32", "none", "lora"), (3, "bf16", "cpu", "lora")]
SWAP = tempfile.mkdtemp(prefix="zerompi-repro-swap-")


def model(frozen: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 48), nn.LayerNorm(48), nn.GELU(), nn.Dropout(0.2), nn.Linear(48, 40),
                      nn.Tanh(), nn.Dropout(0.1), nn.Linear(40, 4))
    if frozen == "lora":  # peft's LoRA on the first and second Linear, with its own dropout; the base frozen
        import peft
        return peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["0", "4"]))
    if frozen:
        m[0].requires_grad_(False)
    return m


DEVICE = "cpu"  # --device


def config(stage, dtype, offload) -> zerompi.ZeroConfig:
    return zerompi.ZeroConfig(stage=stage, dtype=dtype, offload_optimizer=offload, lr=3e-2, weight_decay=0.1,
                              offload_params=offload if stage == 3 else "none", nvme_path=SWAP,
                              clip_grad_norm=0.05, reproducible=True, micro_batches=G, cpu_threads=1, device=DEVICE,
                              bucket_mb=700 * 4 / 2**20, checkpoint_layout="per_rank", abort_on_exception=False)


def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


def digest(engine, norms: list[float]) -> str:
    """The state (common.state_digest) and the norms so far."""
    return state_digest(engine, struct.pack(f"<{len(norms)}d", *norms))


def train(row, save_after=None, ckpt=None, resume=None) -> dict:
    stage, dtype, offload, frozen = row
    engine = zerompi.initialize(model(frozen), config(stage, dtype, offload))
    norms, steps = [], []
    if resume:
        norms = list(engine.load_checkpoint(resume, tag=f"row{ROWS.index(row)}")["norms"])
    for step in range(engine.stats.steps, STEPS if save_after is None else save_after):
        for i in engine.micro_batch_indices():
            x, y = batch(step, i)
            out = engine(x).float()
            engine.backward(((out - y.to(out.device)) ** 2).mean())
        assert engine.step()
        norms.append(engine.stats.last_grad_norm)
        steps.append(digest(engine, norms))  # the state after every step, not only the last
    if save_after is not None:
        engine.save_checkpoint(ckpt, tag=f"row{ROWS.index(row)}", client_state={"norms": norms})
    out = dict(digest=digest(engine, norms), steps=steps, norms=norms, clipped=max(norms) > 0.05,
               indices=engine.micro_batch_indices())
    engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--save-after", type=int)
    p.add_argument("--ckpt")
    p.add_argument("--resume")
    p.add_argument("--rows", help="comma list of row keys (default: all)")
    p.add_argument("--device", default="cpu", help="cuda: compute on the GPU (the ranks share it)")
    a = p.parse_args()
    global DEVICE
    DEVICE = a.device
    rows = {}
    for row in ROWS:
        key = "-".join(map(str, row))
        if a.rows is None or key in a.rows.split(","):
            rows[key] = train(row, a.save_after, a.ckpt, a.resume)
    if COMM.rank == 0:
        write_json(a.out, dict(world=COMM.size, rows=rows))


if __name__ == "__main__":
    main()
