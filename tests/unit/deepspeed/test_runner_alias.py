"""The runner's ``deepspeed`` alias (compat/deepspeed/runner.py) where an import fails, and ahead of other
finders. Each case in a fresh interpreter, so that the alias stays out of this one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import zerompi

_CASES = """
import importlib.abc, importlib.machinery, json, sys, types
from pathlib import Path
import zerompi.compat.deepspeed as package
from zerompi.compat.deepspeed.runner import install_alias

class Other(importlib.abc.MetaPathFinder, importlib.abc.Loader):  # an editable DeepSpeed's finder, say
    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == "deepspeed" else None
    def create_module(self, spec):
        return types.ModuleType(spec.name)
    def exec_module(self, module):
        module.other = True

sys.meta_path.insert(0, Other())
install_alias()
import deepspeed
got = {"first": deepspeed is package}
try:
    import deepspeed.no_such_module
except ModuleNotFoundError as e:
    got["missing"] = [e.name, str(e)]
package.__path__.append(sys.argv[1])  # a module of the package whose own import fails
try:
    import deepspeed.broken_dependency
except ModuleNotFoundError as e:
    got["dependency"] = [e.name, str(e)]
try:
    import deepspeed.raises_unnamed
except ModuleNotFoundError as e:
    got["unnamed"] = [e.name, str(e)]
print(json.dumps(got))
"""


def test_the_alias_answers_first_and_names_what_it_lacks(tmp_path):
    """``import deepspeed`` gives zerompi's package even where another finder ahead would answer (the alias
    is first on sys.meta_path); ``deepspeed.<sub>`` that zerompi has no module for raises
    ModuleNotFoundError naming ``deepspeed.<sub>``; a module of zerompi's package whose own import fails on
    a missing dependency raises that error unchanged, one raised with no name too. Breaks caught: the alias
    inserted second, the missing-module test inverted or dropped, the dependency's error swallowed or its
    missing name read as a string."""
    (tmp_path / "broken_dependency.py").write_text("import no_such_dependency_of_zerompi\n")
    (tmp_path / "raises_unnamed.py").write_text("raise ModuleNotFoundError('raised by hand, with no name')\n")
    out = subprocess.run([sys.executable, "-c", _CASES, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(zerompi.__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] is True
    assert got["missing"] == ["deepspeed.no_such_module", "No module named 'deepspeed.no_such_module': zerompi's "
                              "DeepSpeed API (zerompi.compat.deepspeed) has no deepspeed.no_such_module "
                              "(docs/deepspeed.md)"]
    assert got["dependency"] == ["no_such_dependency_of_zerompi", "No module named 'no_such_dependency_of_zerompi'"]
    assert got["unnamed"] == [None, "raised by hand, with no name"]
