"""The configuration reference (docs/configuration.md) is generated from the config's declarations and
is never stale: every ZeroConfig key once, under its section, with its type, default, allowed values and
the docstring of its declaration (zerompi/tools/config_reference.py).

Breaks: edit a key's docstring, default or choices without regenerating, or add a key without one, and a
test fails."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from zerompi.config import ZeroConfig
from zerompi.tools import config_reference
from zerompi.tools.cli import main

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_page_is_what_the_declarations_generate():
    assert PAGE.read_text() == config_reference.render(), \
        "docs/configuration.md is stale: run `zerompi config-reference --out docs/configuration.md`"


def test_every_key_once_documented_with_its_facts():
    text = config_reference.render()
    for f in dataclasses.fields(ZeroConfig):
        assert text.count(f"\n### `{f.name}`\n") == 1, f.name
    assert "(undocumented)" not in text
    assert "### `stage`\n\ntype `Stage`; default `3`; one of `0`, `1`, `2`, `3`; DeepSpeed: `zero_optimization.stage`." in text
    assert "### `hang_dir`\n\ntype `str | None`; default `None`." in text
    assert "one of `'fp32'`, `'bf16'`, `'fp16'`" in text  # dtype's choices, as a config spells them


def test_the_command_writes_the_page(tmp_path, capsys):
    assert main(["config-reference", "--out", str(tmp_path / "c.md")]) == 0
    assert (tmp_path / "c.md").read_text() == config_reference.render()
    assert main(["config-reference"]) == 0 and capsys.readouterr().out == config_reference.render()
