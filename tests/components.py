"""The real components some tests need beyond the venv: Slurm, a parallel HDF5, Open MPI.

Under ``CI`` (``.ci/run`` sets CI=true) a component that cannot be set up fails
its tests: a suite that skips what it was meant to exercise is not green. On
other machines the tests skip with the reason. Each fixture that sets one up
records its version, and the end of the run lists what ran (tests/conftest.py).
"""
from __future__ import annotations

import os

import pytest

RAN: dict[str, str] = {}
MISSING: dict[str, str] = {}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(component: str, reason: str):
    """Fail under CI, skip elsewhere: ``component`` could not be had, because ``reason``."""
    MISSING[component] = reason
    if in_ci():
        pytest.fail(f"{component} is required when CI is set, and could not be set up: {reason}", pytrace=False)
    pytest.skip(f"{component} not available: {reason}", allow_module_level=True)


def ran(component: str, version: str) -> None:
    RAN[component] = " ".join(version.split())


def summary_lines() -> list[str]:
    lines = [f"{name}: {version}" for name, version in sorted(RAN.items())]
    lines += [f"{name}: NOT RUN ({why})" for name, why in sorted(MISSING.items()) if name not in RAN]
    return lines


def require_module(*names: str, extra: str = "test"):
    """The Python packages ``names`` (of zerompi's ``extra``), recorded with their versions; the last one.
    Also at a test module's top, instead of ``pytest.importorskip``, which skips under CI too."""
    import importlib
    module = None
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            unavailable(name, f"import {name} failed ({e}): pip install -e '.[{extra}]'")
        ran(name, getattr(module, "__version__", "?"))
    return module
