"""What real DeepSpeed needs under plain mpiexec in the comparison workers: rank and size from MPI,
a free port picked by rank 0 (gloo on the CPU)."""
import os
import socket

from mpi4py import MPI


def deepspeed_env() -> None:
    comm = MPI.COMM_WORLD
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()), LOCAL_RANK=str(comm.Get_rank()),
                      LOCAL_WORLD_SIZE=str(comm.Get_size()), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(comm.bcast(port)))
