"""The Trainer and Accelerate runs of test_hf_trainer.py in a venv where DeepSpeed is not installed: what
most users of zerompi have. Under the runner transformers and Accelerate must find a ``deepspeed``
distribution and module (zerompi's); outside it, nothing may stand in for one.

The venv is real: ``python -m venv`` whose site-packages holds every package of the test venv but
DeepSpeed (links to them, so nothing is installed twice). A run there must train the same bits as the
same run in the test venv, where DeepSpeed is installed beside zerompi (and which test_hf_trainer.py
judges against one plain process): the engine and every operation are zerompi's either way, so any
difference would be the frameworks taking another path without DeepSpeed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.components import require_module

from .launcher import HF_STACK, ROOT, TIMEOUT, WORKERS, mpiexec, plain_env, rank_python

TRAINER = WORKERS / "hf_trainer.py"
ACCELERATE = WORKERS / "hf_accelerate.py"
ARGS = ["--max_steps", "4", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
        "--train_sampling_strategy", "sequential", "--learning_rate", "3e-3", "--seed", "0",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
AUTO = {"optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "weight_decay", "betas", "eps")}},
        **{k: "auto" for k in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                               "train_micro_batch_size_per_gpu")}, "bf16": {"enabled": "auto"}}


def without_deepspeed(target: Path) -> Path:
    """A venv at ``target`` with the test venv's packages, DeepSpeed's left out; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True, timeout=300)
    ours = Path(sysconfig.get_paths()["purelib"])
    python = target / "bin" / "python"
    theirs = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    for entry in ours.iterdir():
        if not entry.name.lower().startswith("deepspeed"):
            (theirs / entry.name).symlink_to(entry)
    # What wheels put beside Python in the prefix: MPICH's libmpi, which mpi4py looks for in <prefix>/lib.
    for entry in (Path(sys.prefix) / "lib").iterdir():
        if not entry.name.startswith("python") and not (target / "lib" / entry.name).exists():
            (target / "lib" / entry.name).symlink_to(entry)
    return python


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> Path:
    require_module("transformers", "accelerate", "safetensors", "deepspeed")  # the comparison's side with it
    return without_deepspeed(tmp_path_factory.mktemp("venv") / "no-deepspeed")


def env_for(python: Path) -> dict[str, str]:
    env = plain_env()
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(python.parent), env["PATH"]])
    return env


def test_no_deepspeed_outside_the_runner(python):
    """In that venv plain Python finds no DeepSpeed, as module or distribution: zerompi shadows nothing."""
    probe = ("import importlib.metadata as m, importlib.util as u\n"
             "try:\n    m.version('deepspeed'); found = True\nexcept m.PackageNotFoundError:\n    found = False\n"
             "import zerompi, transformers\nprint(found, u.find_spec('deepspeed') is not None)")
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=TIMEOUT,
                          env=env_for(python))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False"], proc.stdout


def _trainer(python: Path, tmp: Path, stage: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    cfg = tmp / "ds.json"
    zero = {"stage": int(stage), **({"stage3_gather_16bit_weights_on_model_save": True} if stage == "3" else {})}
    cfg.write_text(json.dumps({**AUTO, "zero_optimization": zero}))
    out = tmp / "out"
    proc = subprocess.run([*mpiexec(), "-n", "2", *rank_python(python, HF_STACK), "-m", "zerompi.deepspeed",
                           str(TRAINER), "--output_dir", str(out), "--deepspeed", str(cfg), *ARGS,
                           "--out", str(tmp / "run.json")],
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=env_for(python))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((tmp / "run.json").read_text()), load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("stage", ["3"])  # ZeRO-3: where transformers asks DeepSpeed the most (zero.Init, gathers)
def test_trainer_without_deepspeed_trains_the_same_bits(python, tmp_path, stage):
    """transformers' Trainer with ``--deepspeed`` (HF's "auto" config) under the runner, without DeepSpeed
    installed: the losses, gradient norms and saved weights of the same run with DeepSpeed installed, bitwise."""
    (tmp_path / "without").mkdir()
    (tmp_path / "with").mkdir()
    got, got_w = _trainer(python, tmp_path / "without", stage)
    ref, ref_w = _trainer(Path(sys.executable), tmp_path / "with", stage)
    assert got["world"] == 2 and len(got["losses"]) == 4
    assert (got["losses"], got["grad_norms"]) == (ref["losses"], ref["grad_norms"])
    assert got_w.keys() == ref_w.keys() and all(torch.equal(got_w[n], ref_w[n]) for n in ref_w)


def test_accelerate_without_deepspeed_trains_the_same_bits(python, tmp_path):
    """An Accelerate loop with ``DeepSpeedPlugin(zero_stage=3)`` under the runner, without DeepSpeed installed:
    the final weights of the same loop with DeepSpeed installed, bitwise."""
    from safetensors.torch import load_file
    outs = {}
    for name, py in (("without", python), ("with", Path(sys.executable))):
        outs[name] = tmp_path / f"{name}.st"
        proc = subprocess.run([*mpiexec(), "-n", "2", *rank_python(py, HF_STACK), "-m", "zerompi.deepspeed",
                               str(ACCELERATE), "--out", str(outs[name]), "--stage", "3"], cwd=ROOT, env=env_for(py),
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 0, f"{name} DeepSpeed:\n{proc.stderr[-6000:]}"
    got, ref = (load_file(str(outs[n])) for n in ("without", "with"))
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)
