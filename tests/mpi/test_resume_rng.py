"""A resumed job with dropout continues bitwise: the per-rank RNG state comes back with the checkpoint.

Two runs of 2 ranks, one after the other in one mpiexec job (tests/mpi/batch.py; each covers
stages 1 and 3: starting a job costs more than the training). The first trains a GPT with dropout 0.2 for 4
steps uninterrupted, and, from the same start, 2 steps and a save. The second
builds a fresh model with other initial values, loads, and trains steps 3-4.
Every rank's loss at every step and the final parameters must be bitwise
those of the uninterrupted run. The same job also loads again and reseeds
each rank as a load without RNG restore would leave it (seed + rank): that
control must differ, or dropout did not draw from the RNG this test guards.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from .batch import Batch

STAGES = (1, 3)
STEPS, SAVE_AT = 4, 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume_rng")
    stages = [str(s) for s in STAGES]
    common = ("--root", str(tmp / "ckpt"), "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--stages", *stages)
    batch = Batch("resume_rng.py", tmp_path_factory, whole_file=True)  # both runs in one job, one after the other
    batch.add("save", 2, "--mode", "save", "--out", tmp / "save.npz", *common)
    batch.add("resume", 2, "--mode", "resume", "--out", tmp / "resume.npz", *common, after=["save"])
    batch.run()
    batch.check("save")
    batch.check("resume")
    return np.load(tmp / "save.npz"), np.load(tmp / "resume.npz")


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def _params(npz, stage: int, run: str) -> dict[str, torch.Tensor]:
    prefix = f"s{stage}/{run}/"
    return {k[len(prefix):]: _t(npz[k]) for k in npz.files if k.startswith(prefix)}


@pytest.mark.parametrize("stage", STAGES)
def test_resume_with_dropout_is_bitwise(runs, stage):
    save, resume = runs
    ref_losses = _t(save[f"s{stage}/ref_losses"])
    assert ref_losses.shape == (STEPS, 2)
    # the saving engine started like the reference (both seeded seed + rank by initialize)
    assert torch.equal(_t(save[f"s{stage}/save_losses"]), ref_losses[:SAVE_AT])
    resumed = _t(resume[f"s{stage}/resumed_losses"])
    assert torch.equal(resumed, ref_losses[SAVE_AT:]), (resumed, ref_losses[SAVE_AT:])
    ref, ours = _params(save, stage, "ref"), _params(resume, stage, "resumed")
    assert ref and ref.keys() == ours.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), f"{name} differs after resuming"


@pytest.mark.parametrize("stage", STAGES)
def test_control_without_rng_restore_differs(runs, stage):
    """Without the saved RNG state the dropout masks, hence losses and parameters, are others."""
    save, resume = runs
    control = _t(resume[f"s{stage}/control_losses"])
    assert not torch.equal(control[0], _t(save[f"s{stage}/ref_losses"])[SAVE_AT]), control
    ref, ctl = _params(save, stage, "ref"), _params(resume, stage, "control")
    assert any(not torch.equal(ctl[n], ref[n]) for n in ref)
