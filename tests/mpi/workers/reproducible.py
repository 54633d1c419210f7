"""reproducible=True worker: one SHA-256 of the trained state, the same at every world size.

A small model with dropout and LayerNorm (in the "frozen" rows with a frozen first layer, in the "lora"
rows as peft's LoRA over a frozen base) trains
STEPS steps on G = 6 micro-batches per step, whose data comes from (step, global index) alone, with
gradient clipping that bites (the "noclip" rows without it). For stages 0-3, fp32/bf16, offload none/cpu
(and two NVMe rows), rank 0 writes the SHA-256 of the parameters, masters, optimizer state and gradient
norms after each step, and the final state of the rows without frozen parameters. ``--save-after K --ckpt D``
saves after K steps and stops; ``--resume D`` loads D and trains the remaining steps; ``--swap DIR`` puts
the NVMe rows' swap files there, and each such row reports every rank's host, swap file and its size.
``--cases SPEC`` runs
several of these command lines in one job (workers/cases.py).
"""
import argparse
import base64
import os
import struct
import tempfile

from mpi4py import MPI

import cases
import zerompi
from common import state_digest, state_items, write_json
from repro_model import CLIP, G, LR, SEED, STEPS, WEIGHT_DECAY, batch, loss_of, model

COMM = MPI.COMM_WORLD
ROWS = [(stage, dtype, offload, frozen) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")
        for offload, frozen in (("none", False), ("none" if stage == 0 else "cpu", True))]  # stage 0: no offload
ROWS += [(2, "fp32", "nvme", False), (3, "bf16", "nvme", True), (1, "fp32", "none", "lora"), (3, "bf16", "cpu", "lora")]
# without clipping, for the plain loop's bits (tests/mpi/plain_loop.py)
ROWS += [(stage, dtype, offload, False, "noclip") for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")
         for offload in (("none",) if stage == 0 else ("none", "cpu"))]
SWAP = tempfile.mkdtemp(prefix="zerompi-repro-swap-")
DEVICE = "cpu"  # --device


def config(stage, dtype, offload, clip=CLIP) -> zerompi.ZeroConfig:
    return zerompi.ZeroConfig(stage=stage, dtype=dtype, offload_optimizer=offload, lr=LR, weight_decay=WEIGHT_DECAY,
                              offload_params=offload if stage == 3 else "none", nvme_path=SWAP, seed=SEED,
                              clip_grad_norm=clip, reproducible=True, micro_batches=G, cpu_threads=1, device=DEVICE,
                              bucket_mb=700 * 4 / 2**20, checkpoint_layout="per_rank", abort_on_exception=False)


def digest(engine, norms: list[float]) -> str:
    """The state (common.state_digest) and the norms so far."""
    return state_digest(engine, struct.pack(f"<{len(norms)}d", *norms))


def state(engine) -> dict[str, str]:
    """common.state_items as {label: base64 of its fp32 bytes} (the plain loop's comparison)."""
    return {label: base64.b64encode(data.tobytes()).decode() for label, data in state_items(engine)
            if not isinstance(data, str)}


def train(row, save_after=None, ckpt=None, resume=None) -> dict:
    stage, dtype, offload, frozen = row[:4]
    engine = zerompi.initialize(model(frozen), config(stage, dtype, offload, None if row[4:] else CLIP))
    norms, steps = [], []
    if resume:
        norms = list(engine.load_checkpoint(resume, tag=f"row{ROWS.index(row)}")["norms"])
    for step in range(engine.stats.steps, STEPS if save_after is None else save_after):
        for i in engine.micro_batch_indices():
            x, y = batch(step, i)
            engine.backward(loss_of(engine(x), y))
        assert engine.step()
        norms.append(engine.stats.last_grad_norm)
        steps.append(digest(engine, norms))  # the state after every step, not only the last
    if save_after is not None:
        engine.save_checkpoint(ckpt, tag=f"row{ROWS.index(row)}", client_state={"norms": norms})
    out = dict(digest=digest(engine, norms), steps=steps, norms=norms, clipped=not row[4:] and max(norms) > CLIP,
               indices=engine.micro_batch_indices())
    if frozen is False and save_after is None:  # the final state, for tests/mpi/plain_loop.py
        out["state"] = state(engine)
    swapper = engine.swapper
    if swapper is not None:  # where each rank's swap file is (a node-local disk on a cluster: --swap)
        here = dict(host=MPI.Get_processor_name(), path=swapper.path, bytes=os.path.getsize(swapper.path))
        out["swap"] = COMM.gather(here)
    engine.close()
    return out


def run(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--save-after", type=int)
    p.add_argument("--ckpt")
    p.add_argument("--resume")
    p.add_argument("--rows", help="comma list of row keys (default: all)")
    p.add_argument("--device", default="cpu", help="cuda: compute on the GPU (the ranks share it)")
    p.add_argument("--swap", help="nvme_path of the NVMe rows (default: a new directory under the temp dir)")
    a = p.parse_args(argv)
    global DEVICE, SWAP
    DEVICE = a.device
    if a.swap:
        os.makedirs(a.swap, exist_ok=True)
        SWAP = a.swap
    rows = {}
    for row in ROWS:
        key = "-".join(map(str, row))
        if a.rows is None or key in a.rows.split(","):
            rows[key] = train(row, a.save_after, a.ckpt, a.resume)
    hosts = COMM.gather(MPI.Get_processor_name())
    if COMM.rank == 0:
        write_json(a.out, dict(world=COMM.size, rows=rows, hosts=hosts))


if __name__ == "__main__":
    cases.main(run)
