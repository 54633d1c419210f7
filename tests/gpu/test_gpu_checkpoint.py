"""A checkpoint saved by a GPU job (two ranks sharing one GPU) loads in CPU-only jobs
(CUDA_VISIBLE_DEVICES=""), at the same and at another world size (workers/gpu_ckpt.py).

The loaded parameters must be bitwise the saved ones; both jobs then train the
same steps on the same global batch, the GPU job on, the CPU job from the
checkpoint, and must agree within ORDER_K times the CPU job's order noise
(tests/mpi/tolerance.check_resume): a lost or misplaced optimizer state would not.
"""
from __future__ import annotations

import numpy as np
import pytest

from zerompi.checkpoint import load_full_state_dict

from ..mpi.tolerance import check_resume
from .support import Jobs, requires_cuda, run

pytestmark = requires_cuda

# (stage, dtype, optimizer): SGD's momentum and AdamW's moments are the state that must move
CASES = [(3, "fp32", "sgd"), (1, "bf16", "adamw")]
WORLDS = (2, 3)


def case_id(case) -> str:
    return "stage{}-{}-{}".format(*case)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    def save(stage, dtype, opt):
        base = tmp_path_factory.mktemp(f"gpu-ckpt-{stage}-{dtype}")
        run(2, "gpu_ckpt.py", "--mode", "save", "--root", str(base / "ckpt"), "--out", str(base / "save.npz"),
            "--stage", str(stage), "--dtype", dtype, "--optimizer", opt)
        return base, dict(np.load(base / "save.npz"))

    saved = Jobs(save)

    def resume(stage, dtype, opt, world):
        base, _ = saved(stage, dtype, opt)
        out = base / f"resume{world}.npz"
        run(world, "gpu_ckpt.py", "--mode", "resume", "--root", str(base / "ckpt"), "--out", str(out),
            "--stage", str(stage), "--dtype", dtype, "--optimizer", opt, device="cpu", gpus="")
        return dict(np.load(out))

    return saved, Jobs(resume)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_consolidates_without_mpi(jobs, case):
    base, saved = jobs[0](*case)
    full = load_full_state_dict(base / "ckpt")
    assert {f"saved/{n}" for n in full} == {k for k in saved if k.startswith("saved/")}
    for name in full:
        assert np.array_equal(full[name].numpy(), saved[f"saved/{name}"]), name


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_loads_bitwise_on_cpu(jobs, case, world):
    _, saved = jobs[0](*case)
    resumed = jobs[1](*case, world)
    keys = [k for k in saved if k.startswith("saved/")]
    assert keys and all(np.array_equal(saved[k], resumed[k]) for k in keys)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"np{w}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_training_goes_on_alike(jobs, case, world):
    _, saved = jobs[0](*case)
    check_resume(saved, jobs[1](*case, world), case[1])
