"""The plot helpers the benchmarks share: matplotlib where installed, grouped bars with error bars.

matplotlib is in the peers venv only (benchmarks/setup_peers.sh); without it no plot is drawn.
"""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a note) where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (it is in the peers venv: benchmarks/setup_peers.sh)")
        return None
    return plt


def bars(ax, groups: list, series: list, value, width: float = 0.8, err=None, hatch=None, alpha: float = 1.0,
         label_fmt: str = "{}") -> None:
    """One bar group per entry of ``groups``, one bar per entry of ``series``: ``value(series, group)``
    (None where missing); ``err(series, group)`` gives (lo, hi) for an error bar."""
    step = width / len(series)
    for i, s in enumerate(series):
        xs = [j - width / 2 + (i + 0.5) * step for j in range(len(groups))]
        ys = [value(s, g) for g in groups]
        kw = {}
        if err is not None:
            e = [err(s, g) or (0, 0) for g in groups]
            kw["yerr"] = [[y - lo if y is not None else 0 for y, (lo, _) in zip(ys, e)],
                          [hi - y if y is not None else 0 for y, (_, hi) in zip(ys, e)]]
        ax.bar(xs, [y or 0 for y in ys], step, label=label_fmt.format(s), color=f"C{i}", hatch=hatch,
               alpha=alpha, edgecolor="black", linewidth=0.4, capsize=2, **kw)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=40, ha="right", fontsize=8)


def save(plt, fig, path: Path, dpi: int = 110, **savefig) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, **savefig)
    plt.close(fig)
    return Path(path)


def sibling(prefix: Path, suffix: str) -> Path:
    """``PREFIX-suffix``: the plot files beside a results prefix."""
    return prefix.with_name(prefix.name + suffix)
