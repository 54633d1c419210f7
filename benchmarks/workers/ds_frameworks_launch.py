"""Run a Hugging Face script (Trainer, Accelerate, TRL) under real DeepSpeed and plain ``mpiexec`` on a
machine without CUDA: the DeepSpeed side of benchmarks/frameworks_vs_deepspeed.py.

A stand-in for ``deepspeed``'s launcher, not a way DeepSpeed documents: each rank gets what that launcher
would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, a rendezvous port picked by rank
0) and DeepSpeed's CPU accelerator; and Accelerate, which finds no torch.distributed backend for a DeepSpeed
run without CUDA (and would take each rank for a world of its own), gets gloo, the backend DeepSpeed's CPU
accelerator names. The script then runs as ``__main__``, unchanged.

    mpiexec -n 2 python ds_frameworks_launch.py SCRIPT [ARGS...]
"""
import logging
import os
import runpy
import socket
import sys

from mpi4py import MPI


def deepspeed_env() -> None:
    comm = MPI.COMM_WORLD
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    n = str(comm.Get_size())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(comm.Get_rank()), LOCAL_RANK=str(comm.Get_rank()), WORLD_SIZE=n, LOCAL_WORLD_SIZE=n,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(comm.bcast(port)))


def gloo_for_accelerate() -> None:
    """Where Accelerate finds no backend for a DeepSpeed run, gloo (what it finds on a CUDA machine is nccl)."""
    import accelerate.state as state
    original = state.PartialState._prepare_backend

    def prepare_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        if found is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            found = "gloo"
        return found, kind
    state.PartialState._prepare_backend = prepare_backend


if __name__ == "__main__":
    deepspeed_env()
    import deepspeed  # noqa: E402  (after its environment)

    deepspeed.utils.logger.setLevel(logging.WARNING)
    gloo_for_accelerate()
    script, *rest = sys.argv[1:]
    sys.argv = [script, *rest]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
