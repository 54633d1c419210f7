"""Singleton detection from launcher environments (zerompi/launch_check.py), no MPI needed.

The environments are trimmed copies of what Slurm 22.05 srun (--mpi=none,
pmi2, pmix), MPICH's hydra inside and outside an allocation, and Open MPI's
mpirun actually set for rank 1 of 2 (see tests/mpi/test_slurm.py for the real runs).
"""
from __future__ import annotations

import pytest

from zerompi.errors import ZeroMPIError
from zerompi.comm.launch_check import announced_tasks, check_world_matches_launcher

STEP = {"SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
        "SLURM_NPROCS": "2", "SLURM_PROCID": "1", "SLURM_JOB_NUM_NODES": "1"}
SRUN_NONE = dict(STEP)
SRUN_PMI2 = {**STEP, "SLURM_MPI_TYPE": "pmi2", "PMI_FD": "13", "PMI_RANK": "1", "PMI_SIZE": "2"}
SRUN_PMIX = {**STEP, "SLURM_MPI_TYPE": "pmix", "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.3.0"}
# sbatch's batch shell: the job's task count, but no step.
BATCH = {"SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_PROCID": "0", "SLURM_JOB_NUM_NODES": "1"}
# hydra inside an allocation: its proxy was started by a one-task srun step.
HYDRA_IN_SLURM = {**STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_NPROCS": "1",
                  "SLURM_PROCID": "0", "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "2",
                  "MPI_LOCALRANKID": "1", "PMI_FD": "6"}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "4", "MPI_LOCALRANKID": "1"}
OMPI = {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1"}


@pytest.mark.parametrize("env, tasks, launcher", [
    (SRUN_NONE, 2, "srun"), (SRUN_PMI2, 2, "srun"), (SRUN_PMIX, 2, "srun"),
    (HYDRA_IN_SLURM, 2, "mpiexec"), (HYDRA, 4, "mpiexec"), (OMPI, 3, "mpirun"),
    ({"MPI_LOCALNRANKS": "3"}, 3, "mpiexec"),
], ids=["srun-none", "srun-pmi2", "srun-pmix", "hydra-in-slurm", "hydra", "openmpi", "localnranks"])
def test_announced_tasks(env, tasks, launcher):
    found = announced_tasks(env)
    assert (found.tasks, found.launcher) == (tasks, launcher)


@pytest.mark.parametrize("env", [{}, BATCH, {"PATH": "/usr/bin", "SLURM_JOB_ID": "7"}],
                         ids=["plain", "sbatch-shell", "allocation"])
def test_nothing_announced(env):
    assert announced_tasks(env) is None
    check_world_matches_launcher(1, env)  # `python train.py` inside an allocation is a real singleton


@pytest.mark.parametrize("env", [SRUN_NONE, SRUN_PMI2, SRUN_PMIX, HYDRA_IN_SLURM, HYDRA, OMPI])
def test_matching_world_passes(env):
    check_world_matches_launcher(announced_tasks(env).tasks, env)


@pytest.mark.parametrize("env", [SRUN_NONE, SRUN_PMIX, SRUN_PMI2])
def test_srun_singletons_raise_with_a_hint(env):
    with pytest.raises(ZeroMPIError) as err:
        check_world_matches_launcher(1, env)
    msg = str(err.value)
    assert msg.startswith("task 1 (SLURM_PROCID): srun started 2 tasks")
    assert "but MPI sees a world of 1 on every rank" in msg
    assert f"--mpi={env.get('SLURM_MPI_TYPE', 'none')}" in msg
    assert "try srun --mpi=pmi2, or mpiexec inside the allocation" in msg


@pytest.mark.parametrize("env, launcher", [(HYDRA, "mpiexec"), (HYDRA_IN_SLURM, "mpiexec"), (OMPI, "mpirun")])
def test_foreign_mpiexec_singletons_raise(env, launcher):
    with pytest.raises(ZeroMPIError, match=f"{launcher} started .* processes .* different MPI"):
        check_world_matches_launcher(1, env)


def test_one_task_is_fine():
    env = {**SRUN_NONE, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_NPROCS": "1"}
    check_world_matches_launcher(1, env)
    check_world_matches_launcher(1, {"PMI_SIZE": "1", "PMI_RANK": "0"})


def test_larger_worlds_are_not_judged():
    # Only the singleton case is an error: a sub-communicator or a nested launch is the caller's business.
    check_world_matches_launcher(2, {**SRUN_PMI2, "PMI_SIZE": "8"})


def test_step_count_falls_back_to_ntasks():
    env = {"SLURM_STEP_ID": "3", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}
    with pytest.raises(ZeroMPIError, match="srun started 4 tasks [(]SLURM_NTASKS=4"):
        check_world_matches_launcher(1, env)


def test_garbage_values_are_ignored():
    check_world_matches_launcher(1, {"PMI_SIZE": "two", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": ""})


@pytest.mark.parametrize("value, raises", [("1", False), ("yes", False), ("0", True), ("", True)])
def test_opt_out(value, raises):
    env = {**SRUN_NONE, "ZEROMPI_ALLOW_SINGLETONS": value}
    if raises:
        with pytest.raises(ZeroMPIError, match="ZEROMPI_ALLOW_SINGLETONS=1 allows"):
            check_world_matches_launcher(1, env)
    else:
        check_world_matches_launcher(1, env)


def test_reads_os_environ_by_default(monkeypatch):
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "ZEROMPI_ALLOW_SINGLETONS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SRUN_NONE.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ZeroMPIError, match="srun started 2 tasks"):
        check_world_matches_launcher(1)
