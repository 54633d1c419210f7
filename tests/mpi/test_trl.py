"""TRL's SFTTrainer, as ``trl/scripts/sft.py`` runs it (workers/trl_sft.py), unchanged under
``mpiexec -n 2 python -m zerompi.deepspeed`` with ``--deepspeed`` HF's "auto" config, on the CPU: a Llama
(its own LM head) and a GPT-2 (head tied to the embedding) at ZeRO-3, the Llama at ZeRO-2, both loaded by
``from_pretrained`` from a local directory with a local word-level tokenizer and a local text dataset.

TRL computes the loss with a fused LM head that multiplies by ``lm_head.weight`` outside the head's forward
and asks ``p.ds_status`` first whether it must gather it (compat/deepspeed/param_status.py).

Judged as test_hf_trainer.py judges the Trainer: against the same script as one plain process on the same
global batches (sequential sampling; 2 ranks x 2 micro-batches x accumulation 2 here, 1 x 2 x 4 there), each
step's loss and gradient norm within ORDER_K times the distance to a second summation order of that run
(micro-batches of 4, accumulation 2), and the saved weights within ORDER_K times what that order moves them.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.components import require_module

from .launcher import HF_STACK, ROOT, TIMEOUT, WORKERS, mpiexec, plain_env, rank_python, run_in_turn
from .test_hf_trainer import AUTO, ZERO, weights
from .tolerance import FP32_FLOOR, loss_failures, tensor_failures

SCRIPT = WORKERS / "trl_sft.py"
COMMON = ["--max_steps", "6", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
          "--train_sampling_strategy", "sequential", "--learning_rate", "3e-3", "--seed", "0", "--bf16", "false"]
RUNS = {"llama-zero3": ("llama", "3"), "gpt2-zero3": ("gpt2", "3"), "llama-zero2": ("llama", "2")}

def env_for(tmp) -> dict[str, str]:
    """No download, a datasets cache of the test's own, and none of a launcher's variables (an in-process test
    may have set them: the reference is one plain process)."""
    return {**plain_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "cache"),
            "CUDA_VISIBLE_DEVICES": ""}


def run(cmd: list[str], out, env) -> dict:
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def sft_args(root, model: str, out_dir) -> list[str]:
    return [str(SCRIPT), "--model_name_or_path", str(root / model), "--dataset_name", str(root / "data"),
            "--output_dir", str(out_dir), *COMMON]


ORDERS = (("ref", 2, 4), ("alt", 4, 2))  # one process's 8 rows a step: micro-batch size, accumulation


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The models, tokenizer and dataset (made once, locally), and per model one process on the same 8 rows a
    step: as 4 micro-batches of 2 (ref) and as 2 of 4 (alt). Every run one after another in one process
    (launcher.run_in_turn)."""
    require_module("trl", "datasets", "transformers", "accelerate", "safetensors")
    root = tmp_path_factory.mktemp("trl")
    models = sorted({model for model, _ in RUNS.values()})
    runs = [["--make", str(root)]] + [
        [*sft_args(root, model, root / model / name)[1:], "--per_device_train_batch_size", str(micro),
         "--gradient_accumulation_steps", str(accum), "--out", str(root / f"{model}-{name}.json")]
        for model in models for name, micro, accum in ORDERS]
    run_in_turn(SCRIPT, runs, root, env_for(root))
    return {model: dict({name: dict(json.loads((root / f"{model}-{name}.json").read_text()),
                                    weights=weights(root / model / name)) for name, _, _ in ORDERS}, root=root)
            for model in models}


@pytest.mark.parametrize("case", list(RUNS))
def test_sft_runs_unchanged_and_matches_one_process(reference, tmp_path, case):
    model, stage = RUNS[case]
    refs = reference[model]
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({**AUTO, "zero_optimization": ZERO[stage]}))
    env = {**env_for(refs["root"]), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    got = run([*mpiexec(), "-n", "2", *rank_python(preload=HF_STACK, env=env), "-m", "zerompi.deepspeed",
               *sft_args(refs["root"], model, tmp_path / "out"), "--deepspeed", str(cfg),
               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"], tmp_path / "out.json", env)
    assert_matches_one_process(dict(got, weights=weights(tmp_path / "out")), refs["ref"], refs["alt"])


def assert_matches_one_process(got: dict, ref: dict, *alts: dict) -> None:
    """``got`` (2 ranks) against one process in two or more summation orders: each step's loss and gradient
    norm, and the saved weights, within the order bound (tolerance.py), the order noise being the largest
    distance of an alternative order from the reference."""
    assert got["world"] == 2 and len(got["losses"]) == len(ref["losses"]) == 6

    def farthest(key: str) -> list[float]:
        return [max((a[key][i] for a in alts), key=lambda v, r=r: abs(v - r)) for i, r in enumerate(ref[key])]
    bad = loss_failures(got["losses"], ref["losses"], farthest("losses"), FP32_FLOOR)
    assert not bad, f"losses beyond the order-noise bound (step, ours, ref, bound): {bad}"
    # torch's fp32 norm in the reference (m squares summed: relative error up to m u32), ours in fp64
    m = sum(t.numel() for t in ref["weights"].values())
    for step, (o, r, a) in enumerate(zip(got["grad_norms"], ref["grad_norms"], farthest("grad_norms"))):
        bound = 8 * abs(a - r) + m * 2.0 ** -24 * r
        assert abs(o - r) <= bound, (step, o, r, bound)
    ours = got["weights"]
    assert ours.keys() == ref["weights"].keys()
    err = {n: float((ours[n] - ref["weights"][n]).abs().max()) for n in ours}
    noise = {n: max(float((a["weights"][n] - ref["weights"][n]).abs().max()) for a in alts) for n in ours}
    assert not tensor_failures(err, noise), tensor_failures(err, noise)
