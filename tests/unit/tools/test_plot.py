"""``zerompi plot``: a PNG from metrics.jsonl files, and a clear error (exit code 2) for bad input."""
from __future__ import annotations

import json

import pytest

from zerompi.tools import plot
from zerompi.tools.cli import main
from tests.components import require_module

require_module("matplotlib", extra="examples")


def write_run(directory, rate_key="samples_per_s", accuracy=True):
    directory.mkdir(parents=True)
    rows = []
    for step in range(1, 21):
        row = {"step": step, "loss": 2.0 / step, "lr": 1e-3, rate_key: 1000.0 + step,
               "bytes_sent_total": {"all_gather": step}}
        if accuracy:
            row["accuracy"] = 1 - 1.0 / step
        if step % 10 == 0:
            row["val_loss"] = 2.5 / step
        rows.append(json.dumps(row))
    (directory / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return directory


def test_plot_writes_a_png_of_several_runs(tmp_path):
    a = write_run(tmp_path / "cnn-stage1")
    b = write_run(tmp_path / "gpt-stage3", rate_key="tokens_per_s", accuracy=False)
    out = tmp_path / "pics" / "runs.png"
    assert main(["plot", str(a), str(b / "metrics.jsonl"), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def _png_width(path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")  # the IHDR chunk's width


def test_panels_choose_what_is_drawn(tmp_path, capsys):
    """Four panels by default (loss, accuracy, lr, rate); --panels loss,lr draws two, half as wide."""
    a = write_run(tmp_path / "run")
    every, two = tmp_path / "every.png", tmp_path / "two.png"
    assert main(["plot", str(a), "-o", str(every)]) == 0
    assert main(["plot", str(a), "-o", str(two), "--panels", "loss,lr"]) == 0
    assert abs(_png_width(every) - 2 * _png_width(two)) <= 2
    with pytest.raises(SystemExit) as exit_:
        main(["plot", str(a), "--panels", "loss,speed"])
    assert exit_.value.code == 2
    assert "unknown panel speed: choose among loss, accuracy, lr, rate" in capsys.readouterr().err


def test_plot_defaults_to_the_first_run_directory(tmp_path):
    a = write_run(tmp_path / "run")
    assert main(["plot", str(a)]) == 0
    assert (a / "metrics.png").stat().st_size > 0


def test_series_keeps_numbers_and_labels_by_directory(tmp_path):
    series = plot.read_metrics(str(write_run(tmp_path / "lr-stage0")))
    assert series.label == "lr-stage0"
    assert series.curves["val_loss"][0] == [10, 20]
    assert "bytes_sent_total" not in series.curves


@pytest.mark.parametrize("content, message", [
    (None, "no such metrics file"),
    ('{"step": 1, "loss": 1.0}\nnot json\n', "metrics.jsonl:2: not a JSON object"),
    ('[1, 2]\n', "an integer 'step'"),
    ('{"step": 1, "lr": 0.1}\n', "no 'loss'"),
])
def test_missing_or_malformed_metrics_exit_2_with_a_message(tmp_path, capsys, content, message):
    run = tmp_path / "run"
    if content is not None:
        run.mkdir()
        (run / "metrics.jsonl").write_text(content)
    assert main(["plot", str(run), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerompi plot: ") and message in err
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_names_the_examples_extra(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(plot.UsageError, match=r"zerompi\[examples\]"):
        plot._pyplot()
