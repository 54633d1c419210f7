"""TRL's DPOTrainer and KTOTrainer, as ``trl/scripts/dpo.py`` and ``kto.py`` run them (workers/trl_pref.py),
unchanged under ``mpiexec -n 2 python -m zerompi.deepspeed`` with ``--deepspeed`` HF's "auto" config, on the CPU,
at ZeRO-2 and ZeRO-3: a Llama loaded by ``from_pretrained`` from a local directory, its reference model a second
copy that TRL's ``prepare_deepspeed`` wraps at ZeRO-3 (with the dotted keys it writes), local datasets.

Judged as test_trl.py judges SFT: against the same script as one plain process on the same global batches
(sequential sampling; 2 ranks x 2 micro-batches x accumulation 2 here, 1 x 2 x 4 there), each step's loss and
gradient norm within ORDER_K times the distance to a second summation order of that run (micro-batches of 4,
accumulation 2), and the saved weights within ORDER_K times what that order moves them.

KTO runs with ``loss_type="apo_zero_unpaired"``: its default loss shifts every micro-batch's loss by a KL
estimate that TRL averages over the processes of a micro-step (``gather_for_metrics(kl).mean()``), so a run
on W processes is by TRL's design another computation than one process on the same rows, under DeepSpeed too.
That loss is run at ZeRO-3 as well, and judged against the plain loop in the one layout where the two agree:
the first step, where the policy is its reference and every KL estimate is 0 on every process.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.components import require_module

from .launcher import HF_STACK, ROOT, WORKERS, mpiexec, rank_python, run_in_turn
from .test_hf_trainer import AUTO, ZERO, weights
from .test_trl import COMMON, assert_matches_one_process, env_for, run
from .tolerance import FP32_FLOOR, loss_failures

SCRIPT = WORKERS / "trl_pref.py"
LOSS = {"dpo": [], "kto": ["--loss_type", "apo_zero_unpaired"]}
RUNS = {"dpo-zero2": ("dpo", "2"), "dpo-zero3": ("dpo", "3"), "kto-zero2": ("kto", "2"), "kto-zero3": ("kto", "3")}
ORDERS = (("ref", 2, 4), ("alt", 4, 2))  # one process's 8 rows a step: micro-batch size, accumulation


def pref_args(root, trainer: str, out_dir, loss: list[str]) -> list[str]:
    return [str(SCRIPT), "--trainer", trainer, "--model_name_or_path", str(root / "llama"), "--dataset_name",
            str(root / trainer), "--output_dir", str(out_dir), *COMMON, *loss]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The model and datasets (made once, locally), and per trainer one process on the same 8 rows a step, as
    4 micro-batches of 2 (ref) and as 2 of 4 (alt); KTO's default loss too (kl-ref, kl-alt). One process in turn."""
    require_module("trl", "datasets", "transformers", "accelerate", "safetensors")
    root = tmp_path_factory.mktemp("trl_pref")
    plain = [(trainer, name, micro, accum, LOSS[trainer]) for trainer in LOSS for name, micro, accum in ORDERS]
    plain += [("kto", f"kl-{name}", micro, accum, []) for name, micro, accum in ORDERS]
    runs = [["--make", str(root)]] + [
        [*pref_args(root, trainer, root / f"{trainer}-{name}", loss)[1:], "--per_device_train_batch_size",
         str(micro), "--gradient_accumulation_steps", str(accum), "--out", str(root / f"{trainer}-{name}.json")]
        for trainer, name, micro, accum, loss in plain]
    run_in_turn(SCRIPT, runs, root, env_for(root))
    return dict({f"{trainer}-{name}": dict(json.loads((root / f"{trainer}-{name}.json").read_text()),
                                           weights=weights(root / f"{trainer}-{name}"))
                 for trainer, name, *_ in plain}, root=root)


def zero_run(reference, tmp_path, trainer: str, stage: str, loss: list[str]) -> dict:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({**AUTO, "zero_optimization": ZERO[stage]}))
    env = {**env_for(reference["root"]), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    got = run([*mpiexec(), "-n", "2", *rank_python(preload=HF_STACK, env=env), "-m", "zerompi.deepspeed",
               *pref_args(reference["root"], trainer, tmp_path / "out", loss), "--deepspeed", str(cfg),
               "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"], tmp_path / "out.json", env)
    return dict(got, weights=weights(tmp_path / "out"))


@pytest.mark.parametrize("case", list(RUNS))
def test_preference_trainer_runs_unchanged_and_matches_one_process(reference, tmp_path, case):
    trainer, stage = RUNS[case]
    got = zero_run(reference, tmp_path, trainer, stage, LOSS[trainer])
    assert_matches_one_process(got, reference[f"{trainer}-ref"], reference[f"{trainer}-alt"])


def test_ktos_default_loss_runs_at_zero3_and_its_first_step_is_one_process_step(reference, tmp_path):
    """The KL estimate is 0 at the first step (the policy is its reference), so there the processes' average
    of it is the one process's: step 1's loss and gradient norm within the order bound; the run completes."""
    got = zero_run(reference, tmp_path, "kto", "3", [])
    ref, alt = reference["kto-kl-ref"], reference["kto-kl-alt"]
    assert got["world"] == 2 and len(got["losses"]) == 6
    assert not loss_failures(got["losses"][:1], ref["losses"][:1], alt["losses"][:1], FP32_FLOOR)
    bound = 8 * abs(alt["grad_norms"][0] - ref["grad_norms"][0]) + \
        sum(t.numel() for t in ref["weights"].values()) * 2.0 ** -24 * ref["grad_norms"][0]
    assert abs(got["grad_norms"][0] - ref["grad_norms"][0]) <= bound
