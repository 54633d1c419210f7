"""``zerompi config-reference``: every ZeroConfig key, generated from the config's own declarations.

Each key is declared once, in its section (``zerompi/config/sections/*.py``): a field of the section's
``*Keys`` dataclass, with its type, its default and the docstring under it. This reads those declarations
(the docstrings from the sections' source, the rest from the dataclasses) and writes one Markdown page, a
section per concern, in the order ``ZeroConfig`` lists its keys; a choice's allowed values come from its
enum. ``docs/configuration.md`` is this page, and a test fails when it is stale
(``zerompi config-reference --out docs/configuration.md`` writes it again).
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import sys
import textwrap
import typing
from pathlib import Path

from zerompi.config.declare import SPELLED
from zerompi.config.zero import SECTIONS, ZeroConfig

HEADER = """# Configuration reference

Every key of `ZeroConfig`, by section. Generated from the sections' declarations
(`zerompi/config/sections/`) by `zerompi config-reference --out docs/configuration.md`; a test fails when
this page is stale. Keys are flat: `ZeroConfig(stage=3, offload_optimizer="cpu")`, the `[zero]` table of
a job's TOML, or `ZeroConfig.from_file(path)` (TOML, JSON, or a DeepSpeed JSON config). A wrong key or
value raises `ConfigError` naming the key and what is allowed.
"""


def _docstrings(cls: type) -> dict[str, str]:
    """The docstring written under each field of ``cls``, from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _choices(tp) -> list | None:
    """The allowed values of a choice type (an enum, or an enum or None)."""
    members = [t for t in typing.get_args(tp) or (tp,) if isinstance(t, type) and issubclass(t, enum.Enum)]
    if not members:
        return None
    return [m.value for m in members[0]] + ([None] if type(None) in typing.get_args(tp) else [])


def _plain(value) -> str:
    return repr(value.value if isinstance(value, enum.Enum) else value)


def _type_name(tp) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "").replace("NoneType", "None")


def _section_title(cls: type) -> tuple[str, str]:
    """``Sharding`` and the first line of its module's docstring."""
    doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
    return cls.__name__.removesuffix("Keys"), " ".join(doc.split())


def render() -> str:
    hints = typing.get_type_hints(ZeroConfig)
    lines = [HEADER]
    for section in SECTIONS:
        title, about = _section_title(section)
        docs = _docstrings(section)
        lines += [f"## {title}", "", about, ""]
        for f in dataclasses.fields(section):
            tp = hints[f.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            facts = [f"type `{_type_name(tp)}`", f"default `{_plain(default)}`"]
            allowed = _choices(tp)
            if allowed:
                facts.append("one of " + ", ".join(f"`{v!r}`" for v in allowed))
            facts += [f"{dialect}: `{dotted}`" for dialect, dotted in f.metadata[SPELLED].items()]
            lines += [f"### `{f.name}`", "", "; ".join(facts) + ".", "", docs.get(f.name, "(undocumented)"), ""]
    return "\n".join(lines).rstrip() + "\n"


def run(args) -> int:
    text = render()
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def register(subparsers) -> None:
    """Add ``zerompi config-reference`` to the ``zerompi`` command's subparsers."""
    p = subparsers.add_parser("config-reference", help="print every config key (Markdown), from its declaration",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--out", metavar="PATH", help="write the page here (docs/configuration.md) instead of stdout")
    p.set_defaults(func=run)
