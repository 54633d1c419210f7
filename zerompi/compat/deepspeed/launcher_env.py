"""``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` from the MPI launcher's own variables.

DeepSpeed's launcher sets these before a script starts, and scripts read them before
``deepspeed.initialize`` (HelloDeepSpeed chooses the rank that makes its experiment directory by
``RANK``). Plain ``mpiexec`` sets only its own names, so ``import zerompi.deepspeed`` fills in each
of the four that is unset from them: reading the environment is no MPI call and needs no other
rank. One launcher's names are read, the first found of Open MPI (``OMPI_COMM_WORLD_*``), MPICH's
Hydra (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``) and PMIx (``PMIX_RANK``
alone, so only ``RANK``). The runner (``python -m zerompi.deepspeed``) sets all four from MPI itself.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["LAUNCHERS", "fill_from_launcher"]

LAUNCHERS: tuple[tuple[str, dict[str, str]], ...] = (
    ("Open MPI", {"RANK": "OMPI_COMM_WORLD_RANK", "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
                  "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE"}),
    ("Hydra", {"RANK": "PMI_RANK", "WORLD_SIZE": "PMI_SIZE", "LOCAL_RANK": "MPI_LOCALRANKID",
               "LOCAL_WORLD_SIZE": "MPI_LOCALNRANKS"}),
    ("PMIx", {"RANK": "PMIX_RANK"}),
)
"""Each launcher's variable for each name, in the order they are looked for (by their RANK variable)."""


def fill_from_launcher(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each unset name from the first launcher whose rank variable is in ``environ``; return what was set.

    A value that is not a whole number >= 0 is left out (it cannot be a rank or a size)."""
    for _, names in LAUNCHERS:
        if names["RANK"] in environ:
            break
    else:
        return {}
    added = {}
    for name, source in names.items():
        value = environ.get(source, "").strip()
        if name not in environ and value.isdigit():
            added[name] = environ[name] = str(int(value))
    # DeepSpeed's launcher sets LOCAL_SIZE beside LOCAL_WORLD_SIZE (as the runner does).
    if "LOCAL_WORLD_SIZE" in added and "LOCAL_SIZE" not in environ:
        added["LOCAL_SIZE"] = environ["LOCAL_SIZE"] = added["LOCAL_WORLD_SIZE"]
    return added
