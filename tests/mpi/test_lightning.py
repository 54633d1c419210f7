"""Lightning's Trainer with ``ZeroMPIStrategy`` (zerompi/compat/lightning/) under ``mpiexec -n 2``, on the CPU.

A LightningModule as users write it (workers/lightning_fit.py: AdamW with two param groups, a per-step
LambdaLR, ``accumulate_grad_batches=2``, ``gradient_clip_val=1.0``, ``self.log(..., sync_dist=True)``,
Lightning's own shuffling DistributedSampler) at ZeRO-2 and 3, judged against a plain torch loop in one
process on the same global batches: each step's mean loss within ORDER_K times the distance of another
summation order of that loop (the batch in 4 chunks, one per micro-batch; reversed in 2 chunks), and every
final tensor likewise. A checkpoint written by ModelCheckpoint after the last step of epoch 1 (the engine's HDF5
shards and Lightning's state) and resumed with ``fit(ckpt_path=...)`` ends in the uninterrupted run's bits.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.components import require_module

from .launcher import ROOT, TIMEOUT, WORKERS, mpi_env, mpiexec, plain_env, rank_python
from .tolerance import FP32_FLOOR, loss_failures, tensor_failures

SCRIPT = WORKERS / "lightning_fit.py"
LIGHTNING = ("lightning",)  # imported once by the ranks' fork server (3.7 CPU s a process)
ORDERS = {"ref": [], "chunks4": ["--chunks", "4"], "reversed2": ["--reverse", "--chunks", "2"]}


def run(cmd: list[str], out, env=None) -> dict:
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
                          env=env or mpi_env())
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def ranks(n: int, out, *args: str) -> dict:
    return run([*mpiexec(), "-n", str(n), *rank_python(preload=LIGHTNING), "-m", "mpi4py", str(SCRIPT), *args], out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain loop in one process (no launcher's variables), in each summation order of ORDERS."""
    require_module("lightning")
    tmp = tmp_path_factory.mktemp("lightning_ref")
    env = plain_env()
    return {name: run([*rank_python(preload=LIGHTNING), str(SCRIPT), "--plain", *args], tmp / f"{name}.json", env)
            for name, args in ORDERS.items()}


def tensors(result: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in result["weights"].items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_fit_matches_one_process(reference, tmp_path, stage):
    got = ranks(2, tmp_path / "ours.json", "--stage", str(stage))
    ref = reference["ref"]
    alts = [reference[name] for name in ORDERS if name != "ref"]
    assert got["world"] == 2 and got["global_step"] == 6 and len(got["losses"]) == len(ref["losses"]) == 6
    # per step, the order farthest from the reference
    alt = [max((a["losses"][i] for a in alts), key=lambda v: abs(v - r)) for i, r in enumerate(ref["losses"])]
    bad = loss_failures(got["losses"], ref["losses"], alt, FP32_FLOOR)
    assert not bad, f"losses beyond the order-noise bound (step, ours, ref, bound): {bad}"
    ours, theirs = tensors(got), tensors(ref)
    assert ours.keys() == theirs.keys()  # the buffer too (lightning_module_state_dict)
    scale = {n: max(float(t.abs().max()), 1e-12) for n, t in theirs.items()}
    err = {n: float((ours[n] - theirs[n]).abs().max()) / scale[n] for n in theirs}
    noise = {n: max(float((tensors(a)[n] - theirs[n]).abs().max()) for a in alts) / scale[n] for n in theirs}
    failed = tensor_failures(err, noise)
    assert not failed, f"beyond the order-noise bound (error, bound): {failed}"
    # the LambdaLR from configure_optimizers set the engine's groups: 1e-2 / (1 + 0.5 * 6)
    assert got["lr"] == pytest.approx([1e-2 / 4.0] * 2, rel=1e-12)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_a_checkpoint_continues_bitwise(reference, tmp_path, stage):
    whole = ranks(2, tmp_path / "whole.json", "--stage", str(stage), "--save-dir", str(tmp_path / "ckpt"))
    saved = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    assert (saved / "lightning.ckpt").is_file() and (saved / "checkpoint" / "index.h5").is_file(), \
        sorted(p.name for p in (tmp_path / "ckpt").rglob("*"))
    meta = torch.load(saved / "lightning.ckpt", weights_only=True)
    assert "state_dict" not in meta and "optimizer_states" not in meta and meta["global_step"] == 3
    resumed = ranks(2, tmp_path / "resumed.json", "--stage", str(stage), "--resume", str(saved))
    assert resumed["global_step"] == 6 and len(resumed["losses"]) == 3
    assert resumed["losses"] == whole["losses"][3:]
    assert resumed["weights"] == whole["weights"] and resumed["lr"] == whole["lr"]
