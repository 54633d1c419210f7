"""The example workloads end to end on 2 real ranks: each reaches the quality its README section states."""
from __future__ import annotations

import json

import pytest
import torch

from tests.components import require_module

from .launcher import ROOT, run_mpi


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_linear_regression_reaches_least_squares(tmp_path, stage):
    proc = run_mpi(2, "jobs/linear_regression.py", "--out", str(tmp_path), "--stage", str(stage))
    distance = float(proc.stdout.split("distance to the least-squares solution ")[1].split()[0])
    assert distance <= 1e-4, proc.stdout
    assert "converged" in proc.stdout and "NOT" not in proc.stdout
    rows = records(tmp_path)
    assert rows[-1]["step"] == 60 and rows[-1]["loss"] < 0.02 and rows[-1]["val_loss"] < 0.02
    assert all("samples_per_s" in r and "lr" in r for r in rows)


def test_cnn_reaches_95_percent_on_digits(tmp_path):
    require_module("sklearn", extra="examples")
    proc = run_mpi(2, "jobs/train_cnn.py", "--out", str(tmp_path), "--stage", "3")
    accuracy = float(proc.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy >= 0.95, proc.stdout
    last = records(tmp_path)[-1]
    assert abs(last["val_accuracy"] - accuracy) < 1e-4 and last["accuracy"] > 0.9


def test_cnn_resumes_exactly(tmp_path):
    """BatchNorm running statistics and dropout included: 10 steps + checkpoint + 10 resumed == 20 straight."""
    require_module("sklearn", extra="examples")
    run_mpi(2, "jobs/train_cnn.py", "--out", str(tmp_path / "a"), "--steps", "20")
    run_mpi(2, "jobs/train_cnn.py", "--out", str(tmp_path / "b"), "--steps", "10", "--save-every", "10")
    proc = run_mpi(2, "jobs/train_cnn.py", "--out", str(tmp_path / "b"), "--steps", "20", "--resume")
    assert "resumed from" in proc.stderr
    a, b = records(tmp_path / "a")[-1], records(tmp_path / "b")[-1]
    assert a["step"] == b["step"] == 20
    assert (a["loss"], a["val_loss"], a["val_accuracy"]) == (b["loss"], b["val_loss"], b["val_accuracy"])


def test_classifier_beats_chance_after_mlm_warmup_with_frozen_embeddings(tmp_path):
    """The default config: 60 masked-LM steps, then 240 fine-tuning steps with the embeddings frozen."""
    proc = run_mpi(2, "jobs/train_classifier.py", "--out", str(tmp_path), "--stage", "3")
    accuracy = float(proc.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy >= 0.5, proc.stdout  # chance: 0.25; the README states ~0.68
    rows = records(tmp_path)
    assert [r["phase"] for r in rows if r["step"] in (60, 70)] == ["mlm", "finetune"]
    assert rows[-1]["step"] == 300 and "val_accuracy" in rows[-1]


def test_lora_finetune_job_saves_adapters_and_resumes_exactly(tmp_path):
    """jobs/finetune_lora.py: a meta-device Llama base sharded at stage 3, LoRA from peft. Its
    checkpoints leave the base out; a resumed run rebuilds it and repeats the uninterrupted one."""
    from tests.components import require_module
    require_module("peft", "transformers")
    run_mpi(2, "jobs/finetune_lora.py", "--out", str(tmp_path / "a"), "--steps", "6")
    run_mpi(2, "jobs/finetune_lora.py", "--out", str(tmp_path / "b"), "--steps", "3", "--save-every", "3")
    proc = run_mpi(2, "jobs/finetune_lora.py", "--out", str(tmp_path / "b"), "--steps", "6", "--resume")
    assert "resumed from" in proc.stderr and "adapters in" in proc.stdout
    a, b = records(tmp_path / "a")[-1], records(tmp_path / "b")[-1]
    assert a["step"] == b["step"] == 6 and (a["loss"], a["val_loss"]) == (b["loss"], b["val_loss"])
    assert records(tmp_path / "a")[0]["loss"] > a["loss"]

    import h5py
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM
    from zerompi.checkpoint import load_full_state_dict
    ckpt = tmp_path / "b" / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    with h5py.File(ckpt / tag / "rank00000.h5") as f:  # no frozen shard was written
        assert not any(name.startswith("f") and name[1:].isdigit() for name in f)
    saved = load_full_state_dict(ckpt)
    base_cfg = LlamaConfig(**__import__("tomllib").loads((ROOT / "jobs/configs/lora.toml").read_text())["model"]["base"])
    adapted = PeftModel.from_pretrained(LlamaForCausalLM(base_cfg), tmp_path / "b" / "adapter")
    params = dict(adapted.named_parameters())
    assert sorted(saved) == sorted(n for n, p in params.items() if "lora_" in n)
    for name in saved:
        assert torch.equal(params[name], saved[name]), name
