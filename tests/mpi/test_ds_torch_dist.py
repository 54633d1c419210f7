"""torch.distributed in a DeepSpeed script under plain mpiexec (workers/ds_torch_dist.py): after
``deepspeed.init_distributed()`` the default process group is zerompi's MPI backend, with no
TCP rendezvous, and the collectives scripts call answer as torch documents them, at 2 and 3 ranks.
``MASTER_PORT`` is set all the same (agreed over MPI, for a gloo group a framework builds itself, as
DeepSpeed's MPI discovery sets it); the default group does not use it."""
import pytest

from .launcher import run_worker_json


@pytest.mark.parametrize("world", [2, 3])
def test_torch_distributed_runs_over_mpi(world, tmp_path):
    r = run_worker_json(world, "ds_torch_dist.py", tmp_path / "out.json")
    assert {**r, "master": None} == {"backend": "zerompi_mpi", "world": world, "master": None}
    assert r["master"] is not None and int(r["master"]) > 0


def test_ranks_naming_different_checkpoint_directories_write_one_checkpoint_into_rank_0s(tmp_path):
    r = run_worker_json(2, "ds_save_place.py", tmp_path / "out.json", "--root", str(tmp_path / "ckpt"))
    assert r["dirs"] == ["run-0"] and r["same"], r
    assert len(r["warned"]) == 1 and "run-1/t1" in r["warned"][0] and "run-0/t0" in r["warned"][0], r
