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

DeepSpeed's default ns_method "gram" iterates in fp16 on a CPU with mkldnn fp16 kernels (AVX512-FP16 or
AMX-FP16) and in fp32 elsewhere; zerompi's ops/muon.py asks the same question, so the reference iterates in
the same dtype (each run writes which, and the test checks they agree). The bound holds either way: the
reordered references run the same iteration, so where it is fp16 the order noise includes what fp16
rounding makes of a reordered gradient (measured on an AVX512-FP16 Xeon: the matrices' noise ~8e-4,
errors at most 0.3 of the bound, zerompi and DeepSpeed bitwise equal to each other; DeepSpeed's aspect
scale transposed fails 8 of the 12 tests); the floor under every bound there is one fp16 rounding
(tolerance.py).
The dtype this CPU ran is listed under the suite's real components.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from ..components import ran
from ..peers import deepspeed_python
from .launcher import ROOT, WORKERS, mpi_env, run_worker_json
from .tolerance import FP16_FLOOR, FP32_FLOOR, ORDER_K, loss_failures, tensor_failures

STAGES = (0, 1, 2, 3)
COMPONENT = "Newton-Schulz on this CPU"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds_muon_ref") / "ref.json"
    ref = run_worker_json(1, "ds_muon.py", out, "--impl", "reference", "--world", "2")
    kernels = "mkldnn fp16 kernels" if ref["ns_dtype"] == "torch.float16" else "no mkldnn fp16 kernels"
    ran(COMPONENT, f"gram method in {ref['ns_dtype'].removeprefix('torch.')} ({kernels})")
    return ref


def same_iteration(run: dict, ref: dict) -> None:
    """The order noise bounds a run only if it iterated in the reference's dtype."""
    assert run["ns_dtype"] == ref["ns_dtype"], f"{run['impl']} ran Newton-Schulz in {run['ns_dtype']}, " \
                                               f"the reference in {ref['ns_dtype']}"


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


def floor(ref: dict) -> float:
    """One rounding of the narrowest dtype the arithmetic ran in (tolerance.py)."""
    return FP16_FLOOR if ref["ns_dtype"] == "torch.float16" else FP32_FLOOR


def judge(run: dict, ref: dict) -> None:
    """The run's losses and final weights within ORDER_K times the reference's order noise."""
    same_iteration(run, ref)
    base = ref["ref"]["weights"]
    noise = {n: max(_rel(ref[order]["weights"][n], w) for order in ("alt", "rev")) for n, w in base.items()}
    err = {n: _rel(run["weights"][n], w) for n, w in base.items()}
    failed = tensor_failures(err, noise, floor(ref))
    assert not failed, f"final weights beyond {ORDER_K:g} x order noise (error, bound): {failed}"
    bad = loss_failures(run["losses"], ref["ref"]["losses"], ref["alt"]["losses"], floor(ref))
    assert not bad, f"losses beyond their bound (step, ours, ref, bound): {bad}"


@pytest.mark.parametrize("stage", STAGES)
def test_zerompi_follows_the_reference(zerompi_runs, reference, stage):
    run = {**zerompi_runs[str(stage)], "impl": "zerompi", "ns_dtype": zerompi_runs["ns_dtype"]}
    assert run["losses"][-1] < run["losses"][0], run["losses"]  # it trains
    judge(run, reference)


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_follows_the_reference(deepspeed_runs, reference, stage):
    judge({**deepspeed_runs[str(stage)], "impl": "deepspeed", "ns_dtype": deepspeed_runs["ns_dtype"]}, reference)


@pytest.mark.parametrize("stage", STAGES)
def test_zerompi_and_deepspeed_agree(zerompi_runs, deepspeed_runs, reference, stage):
    """Directly: each tensor within twice the bound (each run may sit on either side of the reference)."""
    assert zerompi_runs["ns_dtype"] == deepspeed_runs["ns_dtype"] == reference["ns_dtype"]
    base, ours, theirs = reference["ref"]["weights"], zerompi_runs[str(stage)], deepspeed_runs[str(stage)]
    noise = {n: max(_rel(reference[o]["weights"][n], w) for o in ("alt", "rev")) for n, w in base.items()}
    err = {n: _rel(ours["weights"][n], theirs["weights"][n]) for n in base}
    bound = {n: 2 * max(ORDER_K * noise[n], floor(reference)) for n in base}
    failed = {n: (e, bound[n]) for n, e in err.items() if not e <= bound[n]}
    assert not failed, f"zerompi vs DeepSpeed at stage {stage} (error, bound): {failed}"
