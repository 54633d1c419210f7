"""The ``zerompi`` command: one subcommand per tool module.

Each tool module exposes ``register(subparsers)``, which adds its subcommand
and sets ``func`` on it; this file only wires them together.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from zerompi.errors import ZeroMPIError

# module -> subcommand it registers (imported lazily so `zerompi --help` stays fast)
TOOLS = ("zerompi.checkpoint.cli", "zerompi.tools.estimate", "zerompi.tools.plot", "zerompi.tools.diagnose",
         "zerompi.tools.config_reference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerompi", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in TOOLS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue  # tool not part of this build
        module.register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ZeroMPIError as e:
        print(f"zerompi {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
