"""Where things are, whichever directory a benchmark is started from.

The checkout goes first on ``sys.path`` so that a benchmark measures the package of its own tree,
installed or not (the workers get the same through ``PYTHONPATH``, see ``launch.job_env``).
"""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
RESULTS = BENCH / "results"
WORKERS = BENCH / "workers"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def shown(path: Path) -> str:
    """``path`` relative to the checkout where it lies inside it (what a report prints), else as given."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)
