"""The jsonl results file of a run.

Line one is the run's ``meta`` (what the benchmark was asked to do: its settings), then one ``row`` line per
measurement as it finishes (flushed, so a run that dies keeps what it measured), then ``meta_end``. Every
line carries a ``stamp`` (stamp.py): the commit and whether the tree was dirty, the UTC time, the load
average, the machine and the versions.
"""
from __future__ import annotations

import enum
import json
from pathlib import Path

from .stamp import loadavg, stamp


class Mode(str, enum.Enum):
    NEW = "w"       # one run per file: the file is the run
    APPEND = "a"    # a history: every run adds its rows (the report picks the latest of each case)


class RowLog:
    """Open a results file, write its ``meta`` line; ``add`` a row; ``close`` writes ``meta_end``."""

    def __init__(self, path: Path, meta: dict | None = None, mode: Mode = Mode.NEW):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.meta = dict(meta or {}, kind="meta")
        self._file = open(self.path, mode.value)
        self._framed = meta is not None  # a file of rows alone (Mode.APPEND histories) has no meta lines
        if self._framed:
            self._write(self.meta)

    def _write(self, line: dict) -> dict:
        line = dict(line, stamp=stamp())
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        return line

    def add(self, row: dict) -> dict:
        """Write one row (``kind`` defaults to "row"); the row as written, stamp included."""
        line = self._write({"kind": "row", **row})
        self.rows.append(line)
        return line

    def close(self, **end) -> None:
        """``meta_end``: the meta again, with the load average at the end (and ``end``)."""
        if self._framed and not self._file.closed:
            self.meta.update(loadavg_end=loadavg(), **end)
            self._write(dict(self.meta, kind="meta_end"))
        self._file.close()

    def __enter__(self) -> RowLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write(path: Path, lines: list[dict]) -> None:
    """A whole results file at once, each line stamped (for benchmarks that measure in one job)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    now = stamp()
    Path(path).write_text("".join(json.dumps(dict(line, stamp=line.get("stamp", now))) + "\n" for line in lines))


def read(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def split(lines: list[dict]) -> tuple[dict, list[dict]]:
    """The run's meta (``meta_end`` where the run finished: it adds the end's load) and its rows."""
    metas = [ln for ln in lines if ln.get("kind") in ("meta", "meta_end")]
    return (dict(metas[-1], kind="meta") if metas else {}), [ln for ln in lines if ln.get("kind") == "row"]


def commit_of(line: dict) -> str:
    """A line's commit: its stamp's, or the field of the lines written before stamps."""
    return line.get("stamp", {}).get("commit") or line.get("commit", "?")


def load_of(line: dict) -> float | None:
    """A line's 1-minute load average: its stamp's, or the ``load`` field (a number or 1/5/15) of older lines."""
    la = line.get("stamp", {}).get("loadavg") or line.get("load")
    return la[0] if isinstance(la, list) else la
