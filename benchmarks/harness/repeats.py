"""Interleaved repeats: repeat 1 of every row, then repeat 2 of every row, ...

Slow drift of the machine (another job starting, the disk cache filling, thermal limits) then falls on
every row alike instead of on the rows that happened to run last; the spread of a row's repeats shows
the noise it saw.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from .rows import RowLog

Item = TypeVar("Item")


def interleaved(items: Sequence[Item], repeats: int) -> Iterator[tuple[int, Item]]:
    for repeat in range(repeats):
        for item in items:
            yield repeat, item


def run(items: Sequence[Item], repeats: int, measure: Callable[[Item, int], dict], log: RowLog,
        show: Callable[[dict], str] | None = None) -> list[dict]:
    """Measure every item ``repeats`` times, interleaved; each measurement is a row of ``log`` (with its
    ``repeat``) as soon as it is taken, and a line on stdout."""
    out = []
    for repeat, item in interleaved(items, repeats):
        row = log.add(dict(measure(item, repeat), repeat=repeat))
        out.append(row)
        print(f"repeat {repeat + 1}/{repeats} {show(row) if show else row.get('row', '')}", flush=True)
    return out


def shown_step(row: dict, key: str = "step_s_median", fmt: str = "{:.2f} s/step") -> str:
    """A row's step time for the progress line, or the first line of why it has none."""
    if row["status"] == "ok":
        return fmt.format(row[key])
    return (row.get("error") or row["status"]).splitlines()[0]
