"""``zerompi plot``: pictures of training runs from their ``metrics.jsonl``.

    zerompi plot out/RUN [out/RUN2 ...] [-o FILE.png]

Each argument is a run directory (holding ``metrics.jsonl``, as the jobs under
``jobs/`` write it) or a metrics file itself. One PNG shows, per run: train and
val loss, accuracy where the run has one (train solid, val dashed), the learning
rate, and throughput (tokens or samples per second). Several runs are overlaid,
one colour each, labelled by run directory name. matplotlib is imported only
here; it comes with the ``examples`` extra.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import NamedTuple

from zerompi.errors import UsageError

logger = logging.getLogger(__name__)

RATES = ("tokens_per_s", "samples_per_s")


class Series(NamedTuple):
    """One run's metrics: its label and, per metric name, (steps, values)."""
    label: str
    curves: dict[str, tuple[list[int], list[float]]]


def metrics_path(arg: str) -> Path:
    path = Path(arg)
    return path / "metrics.jsonl" if path.is_dir() else path


def read_metrics(arg: str) -> Series:
    """The curves of one run; UsageError naming the file and line when it is missing or malformed."""
    path = metrics_path(arg)
    if not path.is_file():
        raise UsageError(f"{path}: no such metrics file (give a run directory holding metrics.jsonl, or the file)")
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{number}: not a JSON object ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise UsageError(f"{path}:{number}: expected a JSON object with an integer 'step', got {line[:80]!r}")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                steps, values = curves.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(float(value))
    if "loss" not in curves:
        raise UsageError(f"{path}: no 'loss' in any record: not a training job's metrics.jsonl")
    label = path.parent.name if path.name == "metrics.jsonl" else path.stem
    return Series(label or str(path), curves)


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise UsageError("zerompi plot needs matplotlib: pip install 'zerompi[examples]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


PANELS = ("loss", "accuracy", "lr", "rate")


def panel_list(text: str) -> tuple[str, ...]:
    """``--panels``: a comma-separated subset of PANELS."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    wrong = [n for n in names if n not in PANELS]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"unknown panel {', '.join(wrong) or repr(text)}: "
                                         f"choose among {', '.join(PANELS)}")
    return names


def draw(runs: list[Series], out: Path, only: tuple[str, ...] | None = None) -> Path:
    """Write the PNG of ``runs`` to ``out``; one panel per kind of curve that some run has (of ``only``'s)."""
    plt = _pyplot()
    has = {k for run in runs for k in run.curves}
    panels = [("loss", ("loss", "val_loss"), "loss (train solid, val dashed)", True)]
    if has & {"accuracy", "val_accuracy"}:
        panels.append(("accuracy", ("accuracy", "val_accuracy"), "accuracy (train solid, val dashed)", False))
    if "lr" in has:
        panels.append(("lr", ("lr",), "learning rate", False))
    rate = [k for k in RATES if k in has]
    if rate:
        panels.append(("rate", tuple(rate), " / ".join(k.replace("_per_s", "/s") for k in rate), False))
    panels = [p for p in panels if only is None or p[0] in only] or panels[:1]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (_, keys, title, log_y) in zip(axes[0], panels):
        for i, run in enumerate(runs):
            colour = f"C{i % 10}"
            for key in keys:
                if key in run.curves:
                    steps, values = run.curves[key]
                    ax.plot(steps, values, color=colour, linestyle="--" if key.startswith("val_") else "-",
                            marker="o" if key.startswith("val_") else None, markersize=3,
                            label=run.label if key == keys[0] or keys[0] not in run.curves else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        values = [v for run in runs for k in keys if k in run.curves for v in run.curves[k][1]]
        if log_y and min(values) > 0 and max(values) > 20 * min(values):  # log only over a wide range
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    runs = [read_metrics(a) for a in args.runs]
    out = Path(args.output) if args.output else metrics_path(args.runs[0]).parent / "metrics.png"
    draw(runs, out, args.panels)
    print(out)
    return 0


def register(subparsers) -> None:
    """Add ``zerompi plot`` to the ``zerompi`` command's subparsers."""
    p = subparsers.add_parser("plot", help="draw loss, accuracy, learning rate and throughput of runs into a PNG",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directory (with metrics.jsonl) or metrics file")
    p.add_argument("-o", "--output", metavar="FILE.png",
                   help="where to write the picture (default: metrics.png in the first run's directory)")
    p.add_argument("--panels", type=panel_list, default=None, metavar="LIST",
                   help=f"comma-separated panels among {', '.join(PANELS)} (default: every kind some run has)")
    p.set_defaults(func=run)
