"""DeepSpeed's Adam without bias correction (``"bias_correction": false``, ``FusedAdam(bias_correction=False)``):
zerompi's UncorrectedAdam (optim/adam.py) against real DeepSpeed 0.19.8's FusedAdam on the CPU.

The bound comes from the same run: the update computed exactly (fp64, with the kernel's fp32 coefficients)
is the reference; UncorrectedAdam and the same update in another fp32 operation order (lerp for the first
moment, the step as a product and a subtraction) are each within D of it, what fp32 rounding alone moves.
DeepSpeed's kernel must be within 8 D of it too. The corrected update, the deliberate break, lies far
outside. (UncorrectedAdam takes the coefficients in fp32 as the kernel does: with fp64 ones, 1 - 0.999
differs by 1.3e-5 relative, it was 9.5e-6 from the kernel here, against 2.4e-7 now.)"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.peers import deepspeed_python
from zerompi.compat.deepspeed import config_from
from zerompi.compat.deepspeed.ops.adam import FusedAdam
from zerompi.optim.adam import PATH, UncorrectedAdam

STEPS, LR, WD = 6, 0.05, 0.1
CASES = [(adamw, bc) for adamw in (True, False) for bc in (True, False)]

_DEEPSPEED_SIDE = """
import json, sys, torch
from deepspeed.ops.adam import FusedAdam
out = []
for adamw, bc, steps, lr, wd in json.load(sys.stdin):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(257))
    grads = [torch.randn(257) for _ in range(steps)]
    opt = FusedAdam([p], lr=lr, bias_correction=bc, weight_decay=wd, adam_w_mode=adamw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    out.append(p.detach().tolist())
print(json.dumps(out))
"""


def by_formula(adamw: bool, dtype: torch.dtype) -> torch.Tensor:
    """The uncorrected update with the kernel's fp32 coefficients, in ``dtype`` (fp64: the exact reference;
    fp32: another operation order than UncorrectedAdam's)."""
    lr, wd, b1, b2, eps = (torch.tensor(x, dtype=torch.float32).item() for x in (LR, WD, 0.9, 0.999, 1e-8))
    torch.manual_seed(0)
    p = torch.randn(257).to(dtype)
    grads = [torch.randn(257).to(dtype) for _ in range(STEPS)]
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for g in grads:
        if adamw:
            p = p - (lr * wd) * p
        else:
            g = g + wd * p
        m = torch.lerp(m, g, 1 - b1)
        v = b2 * v + (1 - b2) * (g * g)
        p = p - lr * (m / (torch.sqrt(v) + eps))
    return p.double()


def ours(adamw: bool, bc: bool) -> torch.Tensor:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(257))
    grads = [torch.randn(257) for _ in range(STEPS)]
    if bc:
        opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([p], lr=LR, weight_decay=WD, foreach=False)
    else:
        opt = UncorrectedAdam([p], lr=LR, weight_decay=WD, decoupled=adamw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.fixture(scope="module")
def deepspeed_params() -> dict:
    proc = subprocess.run([str(deepspeed_python()), "-c", _DEEPSPEED_SIDE],
                          input=json.dumps([[a, b, STEPS, LR, WD] for a, b in CASES]), capture_output=True,
                          text=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {case: torch.tensor(v) for case, v in zip(CASES, json.loads(proc.stdout.strip().splitlines()[-1]))}


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_uncorrected_adam_is_deepspeeds_within_fp32_rounding(deepspeed_params, adamw):
    exact = by_formula(adamw, torch.float64)
    rounding = max((ours(adamw, False).double() - exact).abs().max().item(),
                   (by_formula(adamw, torch.float32) - exact).abs().max().item())  # D
    assert rounding > 0
    theirs = deepspeed_params[(adamw, False)].double()
    assert (theirs - exact).abs().max().item() <= 8 * rounding, rounding
    corrected = (ours(adamw, True).double() - exact).abs().max().item()  # the break: far outside
    assert corrected > 100 * 8 * rounding, (corrected, rounding)


def test_the_config_and_the_built_optimizer_choose_it():
    for kind, decoupled in (("AdamW", True), ("Adam", False)):
        params = {"lr": 1e-3, "bias_correction": False, **({} if decoupled else {"adam_w_mode": False})}
        cfg = config_from({"train_batch_size": 1, "optimizer": {"type": kind, "params": params}})
        assert cfg.optimizer == PATH and cfg.optimizer_class() is UncorrectedAdam
        assert cfg.optimizer_kwargs == ({} if decoupled else {"decoupled": False})
    built = FusedAdam([torch.nn.Parameter(torch.zeros(2))], bias_correction=False, adam_w_mode=False)
    assert built.torch_class is UncorrectedAdam and built.zerompi_name == PATH


@pytest.mark.parametrize("kind", ["AdamW", "Adam"])
def test_the_engine_trains_a_bias_correction_false_config_as_the_optimizer_does(kind):
    """One rank: a flat shard steps element for element as the whole tensors do, so the engine built from
    the DeepSpeed config ends in the bits of UncorrectedAdam run on the model itself (with the config's
    betas, eps and weight decay: a hyperparameter lost on the way would show)."""
    import zerompi
    from zerompi.comm.local import run_ranks
    params = {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05, "bias_correction": False,
              "adam_w_mode": kind == "AdamW"}
    cfg = config_from({"train_batch_size": 1, "optimizer": {"type": kind, "params": params},
                       "zero_optimization": {"stage": 2}}).replace(device="cpu")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    plain = model()
    opt = UncorrectedAdam(plain.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05,
                          decoupled=kind == "AdamW")
    for _ in range(3):
        opt.zero_grad()
        plain(x).square().mean().backward()
        opt.step()

    def rank(group):
        engine = zerompi.initialize(model(), cfg, group=group)
        for _ in range(3):
            engine.backward(engine(x).square().mean())
            engine.step()
        got = engine.full_state_dict()
        engine.close()
        return got
    got = run_ranks(1, rank)[0]
    for name, p in plain.named_parameters():
        assert torch.equal(got[name], p.detach()), name
