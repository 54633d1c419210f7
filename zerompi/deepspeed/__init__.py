"""DeepSpeed's training-script API over zerompi: ``import zerompi.deepspeed as deepspeed``.

The public name of the zerompi/compat/deepspeed package: this module *is* that package,
and ``zerompi.deepspeed.<sub>`` its submodules (``accelerator``, ``comm``, ``ops.adam``,
``zero``, ...), each the very module object under both names, so that state (the comm
group) and classes (``FusedAdam``) are one, whichever name a script imports.

A package rather than a module so that ``python -m zerompi.deepspeed train.py`` runs: once this
has run, ``zerompi.deepspeed.__main__`` is found in zerompi/compat/deepspeed/ (runner.py).

Importing it also sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``, where unset,
from the MPI launcher's variables (launcher_env.py), as DeepSpeed's launcher would have: scripts read
them before ``initialize``. ``import zerompi`` alone leaves the environment alone.
"""
import sys

from zerompi.compat import deepspeed as _package
from zerompi.compat.deepspeed.launcher_env import fill_from_launcher

fill_from_launcher()

_prefix = _package.__name__
for _name, _module in list(sys.modules.items()):
    if _name == _prefix or _name.startswith(_prefix + "."):
        sys.modules[__name__ + _name[len(_prefix):]] = _module
