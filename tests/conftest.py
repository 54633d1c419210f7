"""The fast tier (``pytest -m fast``) and the report of which real components the run exercised.

The fast tier is every unit test (one process; several ranks run as threads of
``zerompi.comm.local``) and the MPI smoke jobs below: one real job each for launch and training,
a resume across world sizes and stages, and a failing rank ending the job. The full suite
(``pytest``, what ``.ci/run`` runs) adds every other MPI job.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from .components import in_ci, summary_lines
from .mpi import launcher  # noqa: F401  first: its snapshot of the environment predates the test modules' imports

HERE = Path(__file__).parent

SMOKE = {  # node ids under tests/mpi/ that run in the fast tier
    "test_job.py::test_train_gpt_tiny[3]",
    "test_checkpoint.py::test_resume[np4s1-to-np2s3-fp32-adamw]",
    "test_reliability.py::test_uncaught_exception_on_one_rank_ends_the_job[2]",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the fast tier: unit tests and a few MPI smoke jobs (pytest -m fast)")
    config.addinivalue_line("markers", "scale: 16-64 rank jobs (tests/mpi/test_scale.py), skipped unless "
                                       "ZEROMPI_SCALE_TESTS=1")


def pytest_collection_modifyitems(config, items):
    found = set()
    for item in items:
        path = Path(str(item.path))
        if path.is_relative_to(HERE / "unit"):
            item.add_marker(pytest.mark.fast)
        elif path.is_relative_to(HERE / "mpi"):
            node = f"{path.name}::{item.name}"
            if node in SMOKE:
                item.add_marker(pytest.mark.fast)
                found.add(node)
    # a renamed smoke test must not silently leave the tier (checked when all of tests/mpi was collected)
    whole_mpi = any(Path(str(a)).resolve() in (HERE, HERE / "mpi") for a in config.args) or not config.args
    if whole_mpi and not config.getoption("keyword") and SMOKE - found:
        raise pytest.UsageError(f"tests/conftest.py SMOKE names tests that do not exist: {sorted(SMOKE - found)}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = summary_lines()
    if lines or in_ci():
        terminalreporter.section("real components")
        for line in lines or ["none of Slurm, parallel HDF5, Open MPI was requested by the selected tests"]:
            terminalreporter.write_line(line)
