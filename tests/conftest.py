"""Print which real components the run exercised (tests/components.py)."""
from __future__ import annotations

from .components import in_ci, summary_lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = summary_lines()
    if lines or in_ci():
        terminalreporter.section("real components")
        for line in lines or ["none of Slurm, parallel HDF5, Open MPI was requested by the selected tests"]:
            terminalreporter.write_line(line)
