"""Run a script as ``__main__`` once per argument list, one after another in this one process: a test
module's single-process references (each a plain run of the script, as ``python SCRIPT ARGS`` would be)
with one interpreter start and one framework import between them instead of one per run.

``python in_turn.py SCRIPT RUNS``: RUNS a JSON file holding a list of argument lists. Each run gets a
fresh module namespace; what a framework keeps between runs in one process (its seeds, its singletons)
each script resets as it starts, as it must for a user who trains twice in one notebook.
"""
import json
import runpy
import sys


def main() -> None:
    script, runs = sys.argv[1], sys.argv[2]
    with open(runs) as f:
        lists = json.load(f)
    for args in lists:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
