"""Reading config documents from TOML and JSON files; every failure is a ConfigError."""
from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from zerompi.errors import ConfigError


class Document(NamedTuple):
    """A config table read from a file, and where it came from for error messages."""

    doc: Mapping[str, Any]
    """The table's keys and values."""
    where: str
    """The file, and ``[table]`` when one top-level table was selected."""


def read_document(path: str | os.PathLike, table: str | None = None) -> Document:
    """The top-level table of a .toml or .json file, or its ``table`` entry."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path={path!r} is not a file path")
    path = Path(path)
    doc, where = load_document(path), str(path)
    if table is not None:
        if not isinstance(table, str) or table not in doc:
            raise ConfigError(f"table={table!r} is not in {where}; its top-level "
                              f"keys are: {', '.join(doc) or '(none)'}")
        doc, where = doc[table], f"{where} [{table}]"
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{where}: table={table!r} holds {doc!r}, not a table")
    return Document(doc, where)


def load_document(path: Path) -> dict[str, Any]:
    """Parse a whole .toml or .json file, which must hold a table."""
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {str(path)!r} has extension {path.suffix!r}, "
                          "which is not one of '.toml', '.json'")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e}") from None
    try:
        doc = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r} nests tables or lists too deeply to be a config") from None
    except ValueError as e:  # TOMLDecodeError and JSONDecodeError both derive from it
        kind = suffix[1:].upper()
        raise ConfigError(f"config file {str(path)!r} is not valid {kind}: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {str(path)!r} holds a {type(doc).__name__}, not a table")
    return doc
