"""reproducible=True on real ranks (workers/reproducible.py): one SHA-256 of the trained state at every
world size from 1 to G = 6, including the uneven 4 and 5 (ranks then run different numbers of
micro-batches), at stages 0-3, fp32 and bf16, offload none, cpu and nvme, with a frozen layer or LoRA (peft), dropout and
gradient clipping that bites: parameters, masters and optimizer state after every step; and a checkpoint
saved at one world size continues bitwise at another.

The independent reference is the plain single-process loop (plain_loop.py, no zerompi code): the rows
without frozen parameters must end in its bits at every world size, with or without clipping, and the
engine's gradient norm must be the exactly summed one within the rounding of its pairwise chunk sums."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from . import plain_loop
from .batch import Batch, run_planned

WORLDS = (1, 2, 3, 4, 5, 6)  # 1..G: 4 and 5 uneven
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
U = 2.0 ** -53  # fp64's unit roundoff


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The worker's runs as one job per world size (tests/mpi/batch.py): every row at each world size,
    and in the same jobs the selected resumes' saves and loads (the saving world size's job first)."""
    batch = Batch("reproducible.py", tmp_path_factory, preload=("peft",))  # the LoRA rows
    base = tmp_path_factory.mktemp("reproducible")
    for n in WORLDS:
        batch.add(f"np{n}", n, "--out", base / f"np{n}.json")
    ran = run_planned(request, batch, {"test_resume_at_another_world_size_continues_bitwise": _resume})
    ran.batch, ran.base = batch, base
    return ran


@pytest.fixture(scope="module")
def runs(jobs):
    for n in WORLDS:
        jobs.batch.check(f"np{n}")
    return {n: json.loads((jobs.base / f"np{n}.json").read_text()) for n in WORLDS}


@pytest.fixture(scope="module")
def plain():
    """The plain loop per (dtype, clipping): None, "exact" and "torch" (and torch's with its norm one
    fp32 rounding up, "nudged")."""
    out = {}
    for name, dtype in DTYPES.items():
        for clip in (None, "exact", "torch"):
            out[name, clip] = plain_loop.train(dtype, clip)
        out[name, "nudged"] = plain_loop.train(dtype, "torch", nudge=2.0 ** -23)
    return out


def engine_state(row: dict) -> dict[str, torch.Tensor]:
    """The worker's final state of a row, by the plain loop's names (a parameter and its master both
    name the fp32 master)."""
    return {label: torch.from_numpy(np.frombuffer(base64.b64decode(data), dtype=np.float32).copy())
            for label, data in row["state"].items()}


def compared_rows(runs):
    for n in WORLDS:
        for key, row in runs[n]["rows"].items():
            if "state" in row:
                yield n, key, row, key.split("-")[1], not key.endswith("noclip")


def test_every_world_size_trains_the_plain_loops_bits(runs, plain):
    """Bit for bit: without clipping the plain loop's; with it, the plain loop that clips by the exact
    norm (both coefficients are max_norm / (norm + 1e-6) in fp64, rounded to fp32 for the product: they
    differ only if the two fp64 norms, within 8 units of roundoff of each other, straddle an fp32
    rounding boundary of the coefficient, about 2^-26 of the time)."""
    checked = 0
    for n, key, row, dtype, clipped in compared_rows(runs):
        ref = plain[dtype, "exact" if clipped else None]["state"]
        for label, got in engine_state(row).items():
            want = ref[label.removesuffix("/master")].flatten()
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
                (n, key, label, float((got - want).abs().max()))
        checked += 1
    assert checked == 23 * len(WORLDS)  # 14 rows without clipping, 9 with


def test_the_norm_is_the_exactly_summed_norm(runs, plain):
    """Each step's norm against sqrt(math.fsum of every fp64 square) of the plain loop's gradient: the
    engine's chunk sums are 10-level pairwise trees of positive terms (relative error <= 10u each), added
    exactly, then a square root (half of that, plus u); the reference rounds once, then takes its root:
    |ours - ref| <= 8u ref."""
    for n, key, row, dtype, clipped in compared_rows(runs):
        ref = plain[dtype, "exact" if clipped else None]["norms"]
        for step, (ours, exact) in enumerate(zip(row["norms"], ref)):
            assert abs(ours - exact) <= 8 * U * exact, (n, key, step, ours, exact)


def test_clipping_is_torchs_within_its_coefficients_rounding(runs, plain):
    """Against the plain loop with torch.nn.utils' clipping (fp32 norm, fp32 coefficient): its
    coefficient and the one from the exact norm differ by k fp32 units in the last place (counted per
    step, in the plain loops: nothing of the engine's sets the bound); one such unit moves the trained
    state by D (measured: torch's norm one rounding up at every step), so the state may differ by up
    to 2 max(k, 1) D."""
    for n, key, row, dtype, clipped in compared_rows(runs):
        if not clipped:
            continue
        torch_run, nudged = plain[dtype, "torch"], plain[dtype, "nudged"]
        ours = [np.float32(plain_loop.rm.CLIP / (v + 1e-6)) for v in plain[dtype, "exact"]["norms"]]
        theirs = [np.float32(np.float32(plain_loop.rm.CLIP) / (np.float32(v) + np.float32(1e-6)))
                  for v in torch_run["torch_norms"]]
        k = max(abs(int(a.view(np.int32)) - int(b.view(np.int32))) for a, b in zip(ours, theirs))
        one = max(float((torch_run["state"][name] - nudged["state"][name]).abs().max()) for name in nudged["state"])
        assert 0 < one < 1e-5, one  # the nudge moves the state, and only by rounding noise
        for label, got in engine_state(row).items():
            diff = float((got - torch_run["state"][label.removesuffix("/master")].flatten()).abs().max())
            assert diff <= 2 * max(k, 1) * one, (n, key, label, diff, k, one)


def test_every_world_size_trains_the_same_bits(runs):
    rows = runs[1]["rows"]
    assert len(rows) == 34
    for key, ref in rows.items():
        assert ref["clipped"] is not key.endswith("noclip"), key  # the clip coefficient is in play, or none is
        steps = {n: tuple(runs[n]["rows"][key]["steps"]) for n in WORLDS}
        assert len(set(steps.values())) == 1, (key, steps)
        assert [runs[n]["rows"][key]["norms"] for n in WORLDS] == [ref["norms"]] * len(WORLDS), key


def test_round_robin_indices(runs):
    assert runs[1]["rows"]["2-fp32-none-False"]["indices"] == [0, 1, 2, 3, 4, 5]
    assert runs[4]["rows"]["2-fp32-none-False"]["indices"] == [0, 4]  # rank 0 of 4: one more than ranks 2-3


RESUMED = "3-fp32-none-False,2-bf16-cpu-True,0-fp32-none-True,3-bf16-nvme-True"


def _resume(add, where, saved, loaded):
    first = add(saved, "--out", where / "saved.json", "--save-after", "2", "--ckpt", where / "ckpt", "--rows", RESUMED)
    add(loaded, "--out", where / "resumed.json", "--resume", where / "ckpt", "--rows", RESUMED, after=[first])


@pytest.mark.parametrize("saved,loaded", [(4, 3), (3, 5)])
def test_resume_at_another_world_size_continues_bitwise(jobs, request, runs, saved, loaded):
    resumed = json.loads((jobs(request) / "resumed.json").read_text())
    assert sorted(resumed["rows"]) == sorted(RESUMED.split(","))
    for key, got in resumed["rows"].items():
        assert got["digest"] == runs[1]["rows"][key]["digest"], key
