"""PNG plots of a bench_peers.py run: step time and memory per rank, by row and world size.

Takes the folded records of harness.summary.fold (one per row, size and world size).
"""
from __future__ import annotations

from pathlib import Path

from harness.plots import bars, pyplot, save, sibling

MiB = 2**20


def _grid(results: list[dict]):
    sizes = list(dict.fromkeys(r["size"] for r in results))
    nps = sorted({r["np"] for r in results})
    rows = list(dict.fromkeys(r["row"] for r in results))
    ok = {(r["size"], r["np"], r["row"]): r for r in results if r["status"] == "ok"}
    return sizes, nps, rows, ok


def _panels(plt, results: list[dict], draw, title: str, ylabel: str, legend: dict, path: Path) -> Path:
    """One panel per model size; ``draw(ax, size, nps, rows, ok)`` puts its bars in."""
    sizes, nps, rows, ok = _grid(results)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        draw(ax, size, nps, rows, ok)
        ax.set_title(title.format(size=size))
        ax.set_ylabel(ylabel)
        ax.legend(**legend)
        ax.grid(axis="y", alpha=0.3)
    return save(plt, fig, path)


def _time_bars(ax, size, nps, rows, ok) -> None:
    def value(np_, row):
        r = ok.get((size, np_, row))
        return r["step_s_median"] if r else None

    def err(np_, row):
        r = ok.get((size, np_, row))
        return (r.get("step_s_lo", r["step_s_min"]), r.get("step_s_hi", r["step_s_max"])) if r else None
    bars(ax, rows, nps, value, err=err, label_fmt="np={}")


def _memory_bars(ax, size, nps, rows, ok) -> None:
    for key, hatch, alpha, fmt in (("rss_peak_max", "//", 0.35, "peak np={}"),
                                   ("rss_steady_max", None, 1.0, "steady np={}")):
        def value(np_, row, key=key):
            r = ok.get((size, np_, row))
            return r[key] / MiB if r else None
        bars(ax, rows, nps, value, hatch=hatch, alpha=alpha, label_fmt=fmt)


def write(results: list[dict], prefix: Path) -> list[Path]:
    """Write {prefix}-time.png and {prefix}-memory.png; the paths written."""
    if not any(r["status"] == "ok" for r in results) or (plt := pyplot()) is None:
        return []
    return [_panels(plt, results, _time_bars, "{size}: step time (median of repeats, bars: their min-max)",
                    "seconds per step (slowest rank)", dict(fontsize=8), sibling(prefix, "-time.png")),
            _panels(plt, results, _memory_bars, "{size}: memory per rank (RSS, largest rank)", "MiB",
                    dict(fontsize=7, ncol=2), sibling(prefix, "-memory.png"))]
