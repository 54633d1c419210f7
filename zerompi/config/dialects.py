"""Config dialects: other frameworks' config files that ``ZeroConfig.from_file`` recognises.

The config knows no other framework. A dialect (zerompi/compat/: DeepSpeed JSON)
registers here when ``zerompi`` is imported; ``from_file`` asks each registered
dialect whether it recognises a document before reading it as ZeroConfig keys,
the way ``codecs.register`` lets encodings plug into ``str.encode``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from zerompi.errors import ConfigError


class Dialect(Protocol):
    name: str
    """How errors name it ("read as a DeepSpeed config")."""

    def recognises(self, doc: Mapping[str, Any]) -> bool: ...

    def read(self, doc: Mapping[str, Any], model: Any = None, **overrides: Any) -> Any:
        """The ZeroConfig ``doc`` says (zero.py imports this module, so it is not named here)."""


_REGISTERED: dict[str, Dialect] = {}


def register(dialect: Dialect) -> None:
    """Make ``from_file`` recognise ``dialect``'s documents (registering one name twice keeps the first)."""
    _REGISTERED.setdefault(dialect.name, dialect)


def recognising(doc: Mapping[str, Any]) -> Dialect | None:
    """The registered dialect that recognises ``doc``, or None (plain ZeroConfig keys)."""
    return next((d for d in _REGISTERED.values() if d.recognises(doc)), None)


def named(name: str) -> Dialect:
    """The registered dialect ``name``."""
    if name not in _REGISTERED:
        raise ConfigError(f"no config dialect {name!r} is registered (known: {sorted(_REGISTERED)}); "
                          "import zerompi first")
    return _REGISTERED[name]
