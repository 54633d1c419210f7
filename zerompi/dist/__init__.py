"""Deprecated name of :mod:`zerompi.comm`, kept for one release.

``zerompi/dist/`` read like build output (Python's ``.gitignore`` templates ignore ``dist/`` at any
depth), so the package moved to ``zerompi/comm/``. ``import zerompi.dist.mpi`` and the like still
work: each ``zerompi.dist.<name>`` is the module ``zerompi.comm.<name>`` itself (one object, so
``isinstance`` checks and module state agree), and the first such import warns once.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_OLD, _NEW = __name__, __name__.rsplit(".", 1)[0] + ".comm"

warnings.warn(f"{_OLD} is deprecated and will be removed in the next release; import {_NEW} instead",
              DeprecationWarning, stacklevel=2)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``zerompi.dist.X`` to the already-importable ``zerompi.comm.X``."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_OLD + "."):
            return None
        if importlib.util.find_spec(_NEW + fullname[len(_OLD):]) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(_NEW + spec.name[len(_OLD):])
        spec.loader_state = module.__spec__  # the import machinery sets __spec__ to the old name
        return module

    def exec_module(self, module):
        """Already executed as zerompi.comm's: only its own ``__spec__`` is put back."""
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())


def __getattr__(name: str):
    return importlib.import_module(f"{_NEW}.{name}")
