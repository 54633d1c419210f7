"""transformers' Trainer with ``--deepspeed``, unchanged (workers/hf_trainer.py), under
``mpiexec -n 2 python -m zerompi.deepspeed``, on the CPU: at ZeRO-1, 2 and 3, and ZeRO-2 with the optimizer
offloaded, HF's "auto" config; and at ZeRO-3 a GPT-2 and a Llama that ``from_pretrained`` loads under
``deepspeed.zero.Init`` (modules without reset_parameters, a re-initialisation over a set of parameters).

Judged against the same script as one plain process (no DeepSpeed) on the same global batches (sequential
sampling; 2 ranks x 2 micro-batches x accumulation 2 there, 2 x 4 here): each step's loss within
ORDER_K times the distance to a second summation order of that run (4 x 2), each step's gradient norm
(before clipping: the gradient's scale, which the loss hides) likewise, and the saved weights within
ORDER_K times what that order moves them.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.components import require_module

from .launcher import HF_STACK, ROOT, TIMEOUT, WORKERS, mpi_env, mpiexec, plain_env, rank_python, run_in_turn
from .tolerance import FP32_FLOOR, loss_failures, tensor_failures

SCRIPT = WORKERS / "hf_trainer.py"
COMMON = ["--max_steps", "6", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
          "--train_sampling_strategy", "sequential", "--learning_rate", "3e-3", "--seed", "0"]
AUTO = {"optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "weight_decay", "betas", "eps")}},
        **{k: "auto" for k in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                               "train_micro_batch_size_per_gpu")}, "bf16": {"enabled": "auto"}}
ZERO = {"1": {"stage": 1}, "2": {"stage": 2}, "3": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "2-offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def run(cmd: list[str], out, env=None) -> dict:
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
                          env=env or mpi_env())
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def weights(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(directory / "model.safetensors"))


RUNS = {**{f"built-zero{k}": ("built", v) for k, v in ZERO.items()},
        "gpt2-pretrained-zero3": ("gpt2", ZERO["3"]), "llama-pretrained-zero3": ("llama", ZERO["3"])}
ORDERS = (("ref", 2, 4), ("alt", 4, 2))  # one process's 8 rows a step: micro-batch size, accumulation


def reference_env() -> dict[str, str]:
    """One plain process (launcher.plain_env), no GPU."""
    return {**plain_env(), "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per model, one process on the same 8 rows a step: as 4 micro-batches of 2 (ref) and as 2 of 4 (alt);
    the pretrained models made first. Every run one after another in one process (launcher.run_in_turn)."""
    require_module("transformers", "accelerate", "safetensors")
    tmp = tmp_path_factory.mktemp("hf_ref")
    models = sorted({model for model, _ in RUNS.values()})
    runs = [["--make", str(tmp)]] + [
        ["--output_dir", str(tmp / model / name), "--optim", "adamw_torch", "--per_device_train_batch_size",
         str(micro), "--gradient_accumulation_steps", str(accum), *model_args(tmp, model), *COMMON,
         "--out", str(tmp / f"{model}-{name}.json")] for model in models for name, micro, accum in ORDERS]
    run_in_turn(SCRIPT, runs, tmp, reference_env())
    return {model: dict({name: dict(json.loads((tmp / f"{model}-{name}.json").read_text()),
                                    weights=weights(tmp / model / name)) for name, _, _ in ORDERS}, dir=tmp)
            for model in models}


def model_args(tmp, model: str) -> list[str]:
    return [] if model == "built" else ["--model_dir", str(tmp / model)]


@pytest.mark.parametrize("case", list(RUNS))
def test_trainer_runs_unchanged_and_matches_one_process(reference, tmp_path, case):
    model, zero = RUNS[case]
    refs = reference[model]
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({**AUTO, "zero_optimization": zero}))
    got = run([*mpiexec(), "-n", "2", *rank_python(preload=HF_STACK), "-m", "zerompi.deepspeed", str(SCRIPT),
               "--output_dir", str(tmp_path / "out"), "--deepspeed", str(cfg), *model_args(refs["dir"], model),
               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", *COMMON],
              tmp_path / "out.json")
    ref, alt = refs["ref"], refs["alt"]
    assert got["world"] == 2 and len(got["losses"]) == len(ref["losses"]) == 6
    bad = loss_failures(got["losses"], ref["losses"], alt["losses"], FP32_FLOOR)
    assert not bad, f"losses beyond the order-noise bound (step, ours, ref, bound): {bad}"
    # The norm before clipping sees the gradient's scale, which Adam and clipping would hide from the loss.
    # The reference's is torch's fp32 norm (sums of m fp32 squares: relative error up to m u32), ours fp64.
    m = sum(t.numel() for n, t in ref["weights"].items() if n != "lm_head.weight")
    for step, (o, r, a) in enumerate(zip(got["grad_norms"], ref["grad_norms"], alt["grad_norms"])):
        bound = 8 * abs(a - r) + m * 2.0 ** -24 * r
        assert abs(o - r) <= bound, (step, o, r, bound)
    ours = weights(tmp_path / "out")
    names = sorted(set(ref["weights"]) & set(ours))
    assert names and {n for n in ref["weights"] if n not in ours} <= {"lm_head.weight"}  # tied to wte
    err = {n: float((ours[n] - ref["weights"][n]).abs().max()) for n in names}
    noise = {n: float((alt["weights"][n] - ref["weights"][n]).abs().max()) for n in names}
    assert not tensor_failures(err, noise), tensor_failures(err, noise)


@pytest.mark.parametrize("stage", ["2", "3"])
def test_resume_from_a_checkpoint_dir_continues_bitwise(tmp_path, stage):
    """--save_steps 3 writes checkpoint-3 (HF's files and a zerompi checkpoint under global_step3);
    --resume_from_checkpoint on it runs steps 4-6 only and ends in the uninterrupted run's bits."""
    require_module("transformers", "accelerate", "safetensors")
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({**AUTO, "zero_optimization": ZERO[stage]}))
    common = [*mpiexec(), "-n", "2", *rank_python(preload=HF_STACK), "-m", "zerompi.deepspeed", str(SCRIPT), "--deepspeed", str(cfg),
              "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", *COMMON,
              "--save_strategy", "steps", "--save_steps", "3"]
    whole = run([*common, "--output_dir", str(tmp_path / "whole")], tmp_path / "whole.json")
    (tmp_path / "resumed").mkdir()
    resumed = run([*common, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint",
                   str(tmp_path / "whole" / "checkpoint-3")], tmp_path / "resumed.json")
    assert (whole["steps_run"], resumed["steps_run"]) == (6, 3)
    assert (tmp_path / "whole" / "checkpoint-3" / "global_step3" / "index.h5").exists()
    assert resumed["losses"][3:] == whole["losses"][3:] and resumed["grad_norms"][3:] == whole["grad_norms"][3:]
    ours, theirs = weights(tmp_path / "resumed"), weights(tmp_path / "whole")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def _plain_env() -> dict[str, str]:
    """One plain process: no launcher's variables, and the workers importable."""
    plain = reference_env()
    plain["PYTHONPATH"] = os.pathsep.join([str(WORKERS), plain["PYTHONPATH"]])
    return plain


@pytest.fixture(scope="module")
def accelerate_reference(tmp_path_factory):
    """The Accelerate loop as one plain process, 4 micro-batches of 2 (ref) and 2 of 4 (alt): the same for every
    stage and offload, so run once for the module (both in one process, launcher.run_in_turn)."""
    require_module("transformers", "accelerate", "safetensors")
    tmp = tmp_path_factory.mktemp("accelerate_ref")
    run_in_turn(WORKERS / "hf_accelerate.py", [["--out", str(tmp / "ref.st"), "--accum", "4"],
                                               ["--out", str(tmp / "alt.st"), "--accum", "2", "--micro", "4"]],
                tmp, _plain_env())
    return tmp


def _near_the_plain_process(reference, saved) -> None:
    """The weights ``saved`` within ORDER_K times the order noise of one plain process on the same batches."""
    from safetensors.torch import load_file
    ref, alt = (load_file(str(reference / f"{n}.st")) for n in ("ref", "alt"))
    ours = load_file(str(saved))
    err = {n: float((ours[n] - ref[n]).abs().max()) for n in ref}
    noise = {n: float((alt[n] - ref[n]).abs().max()) for n in ref}
    assert ours.keys() == ref.keys() and not tensor_failures(err, noise), tensor_failures(err, noise)


@pytest.mark.parametrize("stage,offload", [(2, False), (3, False), (2, True)], ids=["zero2", "zero3", "zero2-offload"])
def test_accelerate_with_the_deepspeed_plugin(accelerate_reference, tmp_path, stage, offload):
    """An Accelerate loop with ``DeepSpeedPlugin(zero_stage=...)`` (workers/hf_accelerate.py), unchanged under the
    runner at 2 ranks: its final weights within ORDER_K times the order noise of one plain process on the same
    batches (4 micro-batches of 2 against 2 of 4)."""
    require_module("transformers", "accelerate", "safetensors")
    script = str(WORKERS / "hf_accelerate.py")
    env = {**mpi_env(), "PYTHONPATH": _plain_env()["PYTHONPATH"]}
    proc = subprocess.run([*mpiexec(), "-n", "2", *rank_python(preload=HF_STACK), "-m", "zerompi.deepspeed", script, "--out",
                           str(tmp_path / "ours.st"), "--stage", str(stage), *(["--offload"] if offload else [])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    _near_the_plain_process(accelerate_reference, tmp_path / "ours.st")


ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero3_save_16bit_model: true
  zero_stage: 3
mixed_precision: 'no'
num_machines: 1
num_processes: 2
"""


def test_accelerate_config_yaml_reaches_the_script(accelerate_reference, tmp_path):
    """``accelerate launch --config_file ds.yaml`` as an MPI job: ``python -m zerompi.deepspeed --accelerate_config
    ds.yaml`` sets what Accelerate's launch would (zero_stage 3, accumulation 2, clipping 1.0), and a script whose
    ``Accelerator()`` has no plugin trains as the zero3 case with the plugin in the script does."""
    require_module("transformers", "accelerate", "safetensors")
    yaml = tmp_path / "ds.yaml"
    yaml.write_text(ACCELERATE_YAML)
    env = {**mpi_env(), "PYTHONPATH": _plain_env()["PYTHONPATH"]}
    proc = subprocess.run([*mpiexec(), "-n", "2", *rank_python(preload=HF_STACK), "-m", "zerompi.deepspeed",
                           "--accelerate_config", str(yaml), str(WORKERS / "hf_accelerate.py"), "--out",
                           str(tmp_path / "ours.st"), "--from-launch"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    _near_the_plain_process(accelerate_reference, tmp_path / "ours.st")
    yaml.write_text(ACCELERATE_YAML.replace("DEEPSPEED", "MULTI_CPU"))
    proc = subprocess.run([*mpiexec(), "-n", "2", *rank_python(preload=HF_STACK), "-m", "zerompi.deepspeed",
                           "--accelerate_config", str(yaml), str(WORKERS / "hf_accelerate.py"), "--out",
                           str(tmp_path / "never.st"), "--from-launch"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and "its distributed_type is not DEEPSPEED" in proc.stderr, proc.stderr[-3000:]
