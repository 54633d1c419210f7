"""Import zerompi.deepspeed under plain mpiexec and print, as JSON, what the environment then says
(as a DeepSpeed script reads it before initialize) beside MPI's own rank and size."""
import json
import os
import sys

import zerompi.deepspeed  # noqa: F401  sets the names from the launcher's variables
from mpi4py import MPI

names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")
row = {"env": {k: os.environ.get(k) for k in names},
       "mpi": [MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()]}
rows = MPI.COMM_WORLD.gather(row)
if MPI.COMM_WORLD.Get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f)
