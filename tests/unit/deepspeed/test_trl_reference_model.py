"""TRL's ``prepare_deepspeed`` (trl/models/utils.py), which DPO, KTO, GRPO, RLOO and the distillation trainers
call for their reference or reward model, on a ZeRO-3 config under the runner's ``deepspeed`` alias: it adds
three tuning sizes as top-level keys with dots in their names, which DeepSpeed ignores and zerompi accepts with
no effect (compat/deepspeed/screen.py). In a fresh interpreter, so that the alias stays out of this one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.components import require_module

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = """
import json, warnings
from zerompi.compat.deepspeed.runner import install_alias
install_alias()
import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from transformers import GPT2Config, GPT2LMHeadModel
from trl.models.utils import prepare_deepspeed

ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
ids = torch.randint(0, 64, (2, 8))
model.eval()
want = model(ids).logits.detach().clone()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    engine = prepare_deepspeed(model, accelerator)
got = engine(ids).logits.detach()
print(json.dumps({"stage": engine.zero_optimization_stage(), "zerompi": type(engine).__module__,
                  "training": engine.module.training, "equal": bool(torch.equal(got, want)),
                  "warnings": [str(w.message) for w in caught]}))
"""


def test_trl_prepare_deepspeed_builds_a_stage3_reference_engine():
    require_module("trl", "accelerate", "transformers")
    env = {**os.environ, "ACCELERATE_USE_DEEPSPEED": "true", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["stage"] == 3 and got["zerompi"] == "zerompi.compat.deepspeed.engine" and not got["training"], got
    assert got["equal"], "the stage-3 reference model's logits differ from the plain model's"
    text = " ".join(got["warnings"])
    for key in ("reduce_bucket_size", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        assert f"'zero_optimization.{key}' at the top level (DeepSpeed reads it nowhere)" in text, text
