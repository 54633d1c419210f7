"""What real DeepSpeed needs under plain mpiexec in the comparison workers: rank and size from MPI,
a free port picked by rank 0 (gloo on the CPU), and an exit that its destructors cannot abort."""
import os
import socket
import sys

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


def exit_past_destructors() -> None:
    """End a worker that ran real DeepSpeed, once it has written what it writes.

    DeepSpeed 0.19.8 on gloo now and then aborts in a destructor at exit ("terminate called without an
    active exception", about 1 run in 20 here, and once in a clean CI run of test_ds_muon), after the
    script has finished: MPI is finalised as at any exit, and the process ends before those destructors run.
    Where ``deepspeed`` is zerompi's alias (the runner), the exit is left as it is.
    """
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is None or "zerompi" in (getattr(deepspeed, "__file__", "") or ""):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.COMM_WORLD.Barrier()  # no rank leaves while another still writes
    MPI.Finalize()
    os._exit(0)
