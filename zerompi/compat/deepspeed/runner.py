"""``python -m zerompi.deepspeed train.py [args]``: run an unchanged DeepSpeed script under mpiexec.

::

    mpiexec -n 4 python -m zerompi.deepspeed train.py --deepspeed_config ds.json

``import deepspeed`` (and ``deepspeed.comm``, ``deepspeed.ops.adam``, ...) in the script, and in
whatever it imports, resolves to zerompi's package, even where real DeepSpeed is installed: a
finder placed first on ``sys.meta_path`` answers every ``deepspeed`` and ``deepspeed.<sub>`` name
with the very module object of ``zerompi.compat.deepspeed`` (``.<sub>``), so state and classes
are one under both names. A ``deepspeed.<sub>`` zerompi has no module for raises
ModuleNotFoundError naming it (a script's ``try: import ... except ImportError`` still works).

Before the script starts, the runner does what DeepSpeed's launcher does for it: it sets
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE`` and ``LOCAL_WORLD_SIZE`` from MPI
(collective: every rank runs the runner), and an uncaught exception on any rank from the script's
first line aborts the job naming the rank, as ``python -m mpi4py`` does; the frameworks that drive
DeepSpeed (transformers, Accelerate) find a ``deepspeed`` distribution and a backend (frameworks.py). ``--local_rank_arg`` appends ``--local_rank=<n>`` to
the script's arguments, as DeepSpeed's launcher does by default. The script then runs as
``__main__`` with ``sys.argv`` = ``[script, *args]`` and its directory first on ``sys.path``;
``-m module`` runs a module instead, as ``python -m`` would.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import runpy
import sys
from types import ModuleType

__all__ = ["DeepSpeedAlias", "install_alias", "main"]

PACKAGE = "zerompi.compat.deepspeed"
ALIAS = "deepspeed"


class _Alias(importlib.abc.Loader):
    """Loads nothing: puts the zerompi module in the alias's place in ``sys.modules``."""

    def __init__(self, target: ModuleType):
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder, replaced in exec_module

    def exec_module(self, module: ModuleType) -> None:
        # The import system reads sys.modules again after this: the alias names the zerompi module.
        sys.modules[module.__spec__.name] = self.target


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    """``deepspeed`` and ``deepspeed.<sub>`` are zerompi's ``zerompi.compat.deepspeed`` (``.<sub>``)."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = PACKAGE + fullname[len(ALIAS):]
        try:
            module = importlib.import_module(real)
        except ModuleNotFoundError as e:
            if e.name is not None and e.name.startswith(PACKAGE) and (real + ".").startswith(e.name + "."):
                raise ModuleNotFoundError(f"No module named {fullname!r}: zerompi's DeepSpeed API "
                                          f"({PACKAGE}) has no {fullname} (docs/deepspeed.md)",
                                          name=fullname) from None
            raise
        return importlib.machinery.ModuleSpec(fullname, _Alias(module), is_package=hasattr(module, "__path__"))

    @staticmethod
    def find_distributions(context=importlib.metadata.DistributionFinder.Context()):
        """``importlib.metadata``'s question for a ``deepspeed`` distribution (frameworks.py)."""
        from zerompi.compat.deepspeed.frameworks import find_distributions
        return iter(find_distributions(context))


def install_alias() -> None:
    """From here on, ``import deepspeed`` in this process imports zerompi's package."""
    if not any(isinstance(f, DeepSpeedAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAlias())
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        if not getattr(sys.modules[name], "__name__", "").startswith(PACKAGE):
            del sys.modules[name]  # a real DeepSpeed imported earlier: forget it


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zerompi.deepspeed",
                                description="Run a DeepSpeed training script over zerompi (under mpiexec); "
                                            "'import deepspeed' in it imports zerompi.deepspeed.")
    p.add_argument("--local_rank_arg", action="store_true",
                   help="append --local_rank=<n> to the script's arguments, as DeepSpeed's launcher does")
    p.add_argument("--accelerate_config", metavar="YAML",
                   help="an `accelerate config` file of a DeepSpeed run: its settings reach the script as under "
                        "`accelerate launch --config_file YAML` (the ACCELERATE_* variables it sets)")
    p.add_argument("-m", dest="module", action="store_true", help="run a module (python -m) instead of a file")
    p.add_argument("script", help="the training script (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Collective: run the script of ``argv`` (default ``sys.argv[1:]``) with ``deepspeed`` aliased."""
    ns = _parse(sys.argv[1:] if argv is None else argv)
    install_alias()
    from zerompi.comm.guard import abort_on_uncaught_exception
    from zerompi.compat.deepspeed import comm
    comm.set_environment()
    # from the script's first line: an exception on one rank ends the job, as under python -m mpi4py
    abort_on_uncaught_exception(comm.world_group())
    from zerompi.compat.deepspeed.frameworks import accelerate_env, add_hint, prepare_accelerate
    if ns.accelerate_config is not None:
        os.environ.update(accelerate_env(ns.accelerate_config))
    prepare_accelerate()
    args = list(ns.args)
    if ns.local_rank_arg:
        args.append(f"--local_rank={os.environ['LOCAL_RANK']}")
    try:
        _run(ns, args)
    except Exception as e:  # a framework's refusal gets a note naming zerompi's way, then goes on as it was
        add_hint(e)
        raise


def _run(ns: argparse.Namespace, args: list[str]) -> None:
    if ns.module:
        sys.argv = [ns.script, *args]
        runpy.run_module(ns.script, run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(ns.script)
    if not os.path.isfile(script):
        raise SystemExit(f"python -m zerompi.deepspeed: no such script: {ns.script}")
    sys.argv = [ns.script, *args]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
