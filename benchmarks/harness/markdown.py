"""The pieces of a markdown report every benchmark writes the same way."""
from __future__ import annotations

import re
from pathlib import Path

from .summary import fmt_spread


def cell(c, fmt: str = "{:.2f}") -> str:
    """A table cell: a spread (summary.spread) reads "median (min–max)", anything else as it prints."""
    return fmt_spread(c, fmt) if isinstance(c, dict) and "median" in c else str(c)


def table(head: list[str], body: list[list]) -> list[str]:
    """The lines of a markdown table, then a blank line."""
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|",
            *("| " + " | ".join(map(cell, r)) + " |" for r in body), ""]


def load(la) -> str:
    """A load average (1, 5, 15 min) as ``0.52/0.61/0.70``."""
    return "/".join(f"{x:.2f}" for x in la)


def short_error(r: dict) -> str:
    """The first line of a failed row's error (exit code or timeout) and its exception, if one shows."""
    lines = r.get("error", "").splitlines() or ["?"]
    raised = [ln.strip() for ln in lines[1:] if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", ln.strip())]
    return (lines[0] + (f": {raised[-1]}" if raised else "")).replace("|", "/")[:200]


def reading(path: str | Path | None) -> str | None:
    """The text of a ``--reading FILE`` note, if one was given."""
    return Path(path).read_text() if path else None


def write(path: Path, text: str) -> Path:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    print(f"wrote {path}")
    return Path(path)
