"""Restoring the saved CUDA RNG state: the decision, and the load path, without a GPU.

A single-process engine (no mpiexec) saves a checkpoint; a fake CUDA RNG
state (16 bytes, the size of a CUDA Philox generator's seed and offset) and
device count are then written into its rank file, and a fresh engine loads
it with ``torch.cuda`` patched: unavailable (skipped, with a warning, CPU RNG
still restored), available with the same or another device count (restored on
the current device, warning for another count), and a state the generator
rejects (warning, the rest loaded). The real CUDA generator is exercised by
tests/gpu when there is a GPU.
"""
from __future__ import annotations

import logging

import h5py
import numpy as np
import pytest
import torch

from zerompi.checkpoint import entries, schema
from zerompi.checkpoint.schema import CUDA_DEVICES, CUDA_RNG
from tests.unit.engines import small_stage3_engine

FAKE = np.arange(16, dtype=np.uint8)


@pytest.mark.parametrize("saved,devices,available,count,restore,warns", [
    (None, None, False, 0, False, None),
    (None, None, True, 2, False, None),
    (FAKE, 1, False, 0, False, "not available"),
    (FAKE, None, False, 0, False, "not available"),
    (FAKE, 2, True, 2, True, None),
    (FAKE, None, True, 4, True, None),      # older checkpoints record no device count
    (FAKE, 8, True, 4, True, "8 CUDA devices"),
])
def test_cuda_rng_decision(saved, devices, available, count, restore, warns):
    ok, warning = entries.cuda_rng_decision(saved, devices, available, count)
    assert ok is restore
    assert (warning is None) if warns is None else (warns in warning)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint whose rank file holds a fake CUDA RNG state (written by 2 devices), and the CPU state."""
    engine = small_stage3_engine()
    root = tmp_path / "ckpt"
    tag = engine.save_checkpoint(root)
    cpu = torch.get_rng_state().clone()
    engine.close()
    with h5py.File(root / tag / schema.rank_file(0), "a") as f:
        for name in (CUDA_RNG, CUDA_DEVICES):
            if name in f:  # a machine with CUDA initialized saved real ones
                del f[name]
        schema.write_array(f, CUDA_RNG, FAKE)
        schema.write_array(f, CUDA_DEVICES, np.array([2], dtype=np.int64))
    return root, cpu


def _load(root, monkeypatch, caplog, available: bool, count: int = 0, reject: bool = False):
    engine = small_stage3_engine()
    torch.rand(5)  # move the CPU generator: the load must put it back
    calls = []

    def set_rng_state(state, device="cuda"):
        if reject:
            raise RuntimeError("RNG state is wrong size")
        calls.append((bytes(state.numpy()), device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    with caplog.at_level(logging.WARNING, logger="zerompi"):
        engine.load_checkpoint(root)
    cpu = torch.get_rng_state().clone()
    monkeypatch.undo()
    engine.close()
    return calls, cpu, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_no_cuda_here_warns_and_restores_only_the_cpu_rng(saved, monkeypatch, caplog):
    root, cpu = saved
    calls, loaded_cpu, warnings = _load(root, monkeypatch, caplog, available=False)
    assert calls == []
    assert torch.equal(loaded_cpu, cpu)
    assert len(warnings) == 1 and "CUDA RNG state" in warnings[0] and "not available" in warnings[0]


def test_cuda_state_is_restored_on_the_current_device(saved, monkeypatch, caplog):
    root, cpu = saved
    calls, loaded_cpu, warnings = _load(root, monkeypatch, caplog, available=True, count=2)
    assert calls == [(FAKE.tobytes(), "cuda")] and warnings == []
    assert torch.equal(loaded_cpu, cpu)


def test_other_device_count_restores_and_warns(saved, monkeypatch, caplog):
    root, _ = saved
    calls, _, warnings = _load(root, monkeypatch, caplog, available=True, count=1)
    assert calls == [(FAKE.tobytes(), "cuda")]
    assert len(warnings) == 1 and "2 CUDA devices" in warnings[0] and "sees 1" in warnings[0]


def test_rejected_cuda_state_warns_and_the_rest_is_loaded(saved, monkeypatch, caplog):
    root, cpu = saved
    calls, loaded_cpu, warnings = _load(root, monkeypatch, caplog, available=True, count=2, reject=True)
    assert calls == [] and torch.equal(loaded_cpu, cpu)
    assert len(warnings) == 1 and "not restored" in warnings[0] and "wrong size" in warnings[0]
