"""launcher_env.py: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from the MPI launcher's variables
(tests/mpi/test_ds_launcher_env.py runs it under MPICH's mpiexec)."""
from __future__ import annotations

import pytest

from zerompi.compat.deepspeed.launcher_env import fill_from_launcher

HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}


@pytest.mark.parametrize("launcher,expected", [
    (HYDRA, {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "4"}),
    (OPEN_MPI, {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "LOCAL_SIZE": "3"}),
    ({"PMIX_RANK": "7"}, {"RANK": "7"}),  # PMIx gives the rank alone
    # Open MPI 5 sets PMIX_RANK beside its own names: one launcher's names are read, its own first
    ({**OPEN_MPI, "PMIX_RANK": "0"}, {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3",
                                      "LOCAL_SIZE": "3"}),
])
def test_names_from_each_launcher(launcher, expected):
    environ = dict(launcher)
    assert fill_from_launcher(environ) == expected
    assert environ == {**launcher, **expected}


def test_names_already_set_are_kept():
    environ = {**HYDRA, "RANK": "0", "LOCAL_SIZE": "9"}  # e.g. mpiexec -env RANK 0 (MPMD form)
    assert fill_from_launcher(environ) == {"WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert (environ["RANK"], environ["LOCAL_SIZE"]) == ("0", "9")


def test_nothing_without_a_launcher_or_with_values_that_are_no_numbers():
    environ = {"PATH": "/bin", "MPI_LOCALRANKID": "0"}  # no rank variable: no launcher
    assert fill_from_launcher(environ) == {} and environ == {"PATH": "/bin", "MPI_LOCALRANKID": "0"}
    assert fill_from_launcher({"PMI_RANK": "x", "PMI_SIZE": "-2", "MPI_LOCALRANKID": " 1 "}) == {"LOCAL_RANK": "1"}
