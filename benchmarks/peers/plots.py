"""PNG plots of a bench_peers.py run: step time and memory per rank, by row and world size.

Takes the folded records of repeats.fold (one per row, size and world size).

Uses matplotlib (installed in the peers venv only); without it no plot is written.
"""
from __future__ import annotations

from pathlib import Path

MiB = 2**20


def _grid(results: list[dict]):
    sizes = list(dict.fromkeys(r["size"] for r in results))
    nps = sorted({r["np"] for r in results})
    rows = list(dict.fromkeys(r["row"] for r in results))
    ok = {(r["size"], r["np"], r["row"]): r for r in results if r["status"] == "ok"}
    return sizes, nps, rows, ok


def _bars(ax, rows, nps, value, width=0.8, err=None, hatch=None, alpha=1.0, label_fmt="np={}"):
    """One bar group per row, one bar per world size; ``value(np, row)`` is None where missing."""
    step = width / len(nps)
    for i, np_ in enumerate(nps):
        xs = [j - width / 2 + (i + 0.5) * step for j in range(len(rows))]
        ys = [value(np_, row) for row in rows]
        kw = {}
        if err is not None:
            e = [err(np_, row) or (0, 0) for row in rows]
            kw["yerr"] = [[y - lo if y is not None else 0 for y, (lo, _) in zip(ys, e)],
                          [hi - y if y is not None else 0 for y, (_, hi) in zip(ys, e)]]
        ax.bar(xs, [y or 0 for y in ys], step, label=label_fmt.format(np_), color=f"C{i}", hatch=hatch,
               alpha=alpha, edgecolor="black", linewidth=0.4, capsize=2, **kw)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(rows, rotation=40, ha="right", fontsize=8)


def _time_plot(plt, results, path: Path) -> None:
    sizes, nps, rows, ok = _grid(results)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        def value(np_, row):
            r = ok.get((size, np_, row))
            return r["step_s_median"] if r else None

        def err(np_, row):
            r = ok.get((size, np_, row))
            return (r.get("step_s_lo", r["step_s_min"]), r.get("step_s_hi", r["step_s_max"])) if r else None
        _bars(ax, rows, nps, value, err=err)
        ax.set_title(f"{size}: step time (median of repeats, bars: their min-max)")
        ax.set_ylabel("seconds per step (slowest rank)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _memory_plot(plt, results, path: Path) -> None:
    sizes, nps, rows, ok = _grid(results)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.2), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for key, hatch, alpha, fmt in (("rss_peak_max", "//", 0.35, "peak np={}"),
                                       ("rss_steady_max", None, 1.0, "steady np={}")):
            def value(np_, row, key=key):
                r = ok.get((size, np_, row))
                return r[key] / MiB if r else None
            _bars(ax, rows, nps, value, hatch=hatch, alpha=alpha, label_fmt=fmt)
        ax.set_title(f"{size}: memory per rank (RSS, largest rank)")
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: list[dict], prefix: Path) -> list[Path]:
    """Write {prefix}-time.png and {prefix}-memory.png; the paths written."""
    if not any(r["status"] == "ok" for r in results):
        return []
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (it is in the peers venv: benchmarks/setup_peers.sh)")
        return []
    time_png = prefix.with_name(prefix.name + "-time.png")
    mem_png = prefix.with_name(prefix.name + "-memory.png")
    _time_plot(plt, results, time_png)
    _memory_plot(plt, results, mem_png)
    return [time_png, mem_png]
