"""Lightning's ``strategy="deepspeed_stage_3"`` under the runner (``python -m zerompi.deepspeed``), as a Lightning
user coming from DeepSpeed starts it on a CPU: Lightning's own check refuses anything but CUDA, and the
traceback then carries a note naming zerompi's Lightning strategy. In a fresh interpreter, so that the
runner's alias stays out of this one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.components import require_module

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = """
import torch
from lightning import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset


class Tiny(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
Trainer(strategy="deepspeed_stage_3", accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False).fit(Tiny(), data)
"""


def test_lightning_deepspeed_stage_3_on_a_cpu_stops_naming_zerompis_strategy(tmp_path):
    """Guards: the refusal alone ("only supported on CUDA GPUs"), which names no way forward."""
    require_module("lightning")
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "zerompi.deepspeed", str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "The DeepSpeed strategy is only supported on CUDA GPUs" in proc.stderr, proc.stderr[-4000:]
    assert 'Trainer(strategy="zerompi_stage_3")' in proc.stderr and "ZeroMPIStrategy" in proc.stderr, \
        proc.stderr[-4000:]
