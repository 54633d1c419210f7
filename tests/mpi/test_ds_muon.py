"""DeepSpeed's ``"optimizer": {"type": "Muon"}`` under zerompi and under real DeepSpeed 0.19.8, at stages 0-3.

One script (workers/ds_muon.py) trains one engine per stage on 2 ranks, under zerompi and under DeepSpeed
(the test extra's, gloo on the CPU), and a single-process reference trains the same model with zerompi's
Muon on the tagged matrices and torch's AdamW on the rest, in three summation orders. DeepSpeed
orthogonalises each matrix whole at every stage (stages 1-2 on the all-reduced gradient in its
partition, stage 3 on gathered gradients, stage 0 on every rank), so each run must follow the reference
within tests/mpi/tolerance.py's bound: per step's loss, and per tensor of the final weights, ORDER_K times
what summation order alone moves in the same run. Both within that bound of one reference, zerompi and
DeepSpeed agree with each other as closely as summation order allows.

DeepSpeed's Newton-Schulz runs eager here (``TORCHDYNAMO_DISABLE=1``): its ``torch.compile`` takes about 50 s
of the job on 2 cores (71 s against 24 s) and is not what is compared; the arithmetic is the same iteration.

The comparison needs Newton-Schulz in fp32, which DeepSpeed's default ns_method "gram" runs on a CPU
without mkldnn fp16 kernels; where it runs in fp16, rounding to 16 bits dominates and this bound does not
apply. Such a CPU skips the tests, saying so, and fails them under CI (tests/components.py): a CI machine
must be one where the comparison runs.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from zerompi.compat.deepspeed.ops.muon import ns_dtype

from ..components import ran, unavailable
from ..peers import deepspeed_python
from .launcher import ROOT, WORKERS, mpi_env, run_worker_json
from .tolerance import FP32_FLOOR, ORDER_K, loss_failures, tensor_failures

STAGES = (0, 1, 2, 3)
COMPONENT = "fp32 Newton-Schulz"


@pytest.fixture(scope="module", autouse=True)
def fp32_newton_schulz():
    """A CPU on which DeepSpeed's gram method iterates in fp32 (no mkldnn fp16), as the bound requires."""
    if ns_dtype("gram", torch.device("cpu")) != torch.float32:
        unavailable(COMPONENT, "Newton-Schulz runs in fp16 on this CPU (mkldnn fp16 kernels, DeepSpeed's gram "
                               "method): the fp32 order-noise bound does not apply")
    ran(COMPONENT, "a CPU without mkldnn fp16 (DeepSpeed's gram method in fp32)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_muon_ref") / "ref.json"
    return run_worker_json(1, "ds_muon.py", out, "--impl", "reference", "--world", "2")


@pytest.fixture(scope="module")
def zerompi_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_muon_zerompi") / "out.json"
    return run_worker_json(2, "ds_muon.py", out, "--impl", "zerompi")


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    python = deepspeed_python()
    out = tmp_path_factory.mktemp("ds_muon_deepspeed") / "out.json"
    cmd = [str(python.with_name("mpiexec")), "-n", "2", str(python), "-m", "mpi4py", str(WORKERS / "ds_muon.py"),
           "--impl", "deepspeed", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT, check=False,
                          env={**mpi_env(), "DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max()).item()


def judge(run: dict, ref: dict) -> None:
    """The run's losses and final weights within ORDER_K times the reference's order noise."""
    base = ref["ref"]["weights"]
    noise = {n: max(_rel(ref[order]["weights"][n], w) for order in ("alt", "rev")) for n, w in base.items()}
    err = {n: _rel(run["weights"][n], w) for n, w in base.items()}
    failed = tensor_failures(err, noise)
    assert not failed, f"final weights beyond {ORDER_K:g} x order noise (error, bound): {failed}"
    bad = loss_failures(run["losses"], ref["ref"]["losses"], ref["alt"]["losses"], FP32_FLOOR)
    assert not bad, f"losses beyond their bound (step, ours, ref, bound): {bad}"


@pytest.mark.parametrize("stage", STAGES)
def test_zerompi_follows_the_reference(zerompi_runs, reference, stage):
    run = zerompi_runs[str(stage)]
    assert run["losses"][-1] < run["losses"][0], run["losses"]  # it trains
    judge(run, reference)


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_follows_the_reference(deepspeed_runs, reference, stage):
    judge(deepspeed_runs[str(stage)], reference)


@pytest.mark.parametrize("stage", STAGES)
def test_zerompi_and_deepspeed_agree(zerompi_runs, deepspeed_runs, reference, stage):
    """Directly: each tensor within twice the bound (each run may sit on either side of the reference)."""
    base, ours, theirs = reference["ref"]["weights"], zerompi_runs[str(stage)], deepspeed_runs[str(stage)]
    noise = {n: max(_rel(reference[o]["weights"][n], w) for o in ("alt", "rev")) for n, w in base.items()}
    err = {n: _rel(ours["weights"][n], theirs["weights"][n]) for n in base}
    failed = {n: (e, 2 * max(ORDER_K * noise[n], FP32_FLOOR)) for n, e in err.items()
              if not e <= 2 * max(ORDER_K * noise[n], FP32_FLOOR)}
    assert not failed, f"zerompi vs DeepSpeed at stage {stage} (error, bound): {failed}"
