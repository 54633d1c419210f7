"""Gate and launcher of the GPU suite.

Every test module is marked ``requires_cuda``: without a GPU each test is
skipped with the reason before any fixture runs, so no MPI job starts.

``ZEROMPI_GPU_SUITE_DEVICE=cpu`` runs the suite's plumbing on the CPU instead
(the workers get ``--device cpu``), and skips what only a GPU has (pinned host
memory). It checks the tests and workers, never a GPU path.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from ..mpi.launcher import run_mpi, run_worker_json

DEVICE = os.environ.get("ZEROMPI_GPU_SUITE_DEVICE", "cuda")
WORKERS = "tests/gpu/workers"


def _missing() -> str | None:
    if DEVICE == "cpu":
        return None
    if not torch.cuda.is_available():
        return (f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda or 'none'}); run on a GPU machine")
    return None


MISSING = _missing()
requires_cuda = pytest.mark.skipif(MISSING is not None, reason=MISSING or "CUDA is available")


@contextlib.contextmanager
def visible_devices(value: str | None = None):
    """The environment the MPI jobs inherit: CUDA_VISIBLE_DEVICES=``value``, by default the first
    visible GPU only, so that both ranks share one GPU as the suite means them to."""
    if value is None:
        current = os.environ.get("CUDA_VISIBLE_DEVICES")
        value = current.split(",")[0].strip() if current else "0"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", value)
        yield


def run_json(n: int, worker: str, out: Path, *args: str) -> dict | list:
    """``tests/gpu/workers/WORKER`` on ``n`` ranks sharing one GPU; rank 0's JSON."""
    with visible_devices():
        return run_worker_json(n, f"{WORKERS}/{worker}", out, "--device", DEVICE, *args)


def rows_by_cuda_aware(tmp_path_factory, worker: str):
    """``get(setting)``: ``worker``'s rows on 2 ranks with ``--cuda-aware setting``, one job per setting and
    module; a setting initialize refuses (the worker writes ``{"skipped": its ConfigError}``) skips the
    tests that ask for it, with MPI's own answer."""
    def start(setting):
        out = tmp_path_factory.mktemp(f"{Path(worker).stem}-{setting}") / "rows.json"
        return run_json(2, worker, out, "--cuda-aware", setting)

    jobs = Jobs(start)

    def get(setting: str) -> list[dict]:
        got = jobs(setting)
        if isinstance(got, dict):
            pytest.skip(f"cuda_aware_mpi={setting!r} refused: {got['skipped']}")
        return got
    return get


def run(n: int, worker: str, *args: str, device: str = DEVICE, gpus: str | None = None) -> None:
    """``tests/gpu/workers/WORKER`` on ``n`` ranks; ``gpus`` sets CUDA_VISIBLE_DEVICES ("" hides them)."""
    with visible_devices(gpus):
        run_mpi(n, f"{WORKERS}/{worker}", "--device", device, *args)


class Jobs:
    """Runs ``start(*key)`` once per key and module; a failed job fails, with its output, every
    test that needs it, instead of running again for each."""

    def __init__(self, start):
        self.start, self.done = start, {}

    def __call__(self, *key):
        if key not in self.done:
            try:
                self.done[key] = self.start(*key)
            except AssertionError as e:  # run_mpi's report of a failed job
                self.done[key] = e
        got = self.done[key]
        if isinstance(got, AssertionError):
            pytest.fail(str(got), pytrace=False)
        return got
