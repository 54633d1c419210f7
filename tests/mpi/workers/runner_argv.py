"""Under the runner (python -m zerompi.deepspeed), what the script sees: ``deepspeed``'s module, its own
argv, sys.path[0] and __name__, whether Accelerate's backend lookup was prepared. Each rank writes
``<out>/rank<r>.json``; with ``raise-on-1`` as its last argument rank 1 raises instead while rank 0
waits in a barrier (the runner's abort must end the job)."""
import json
import os
import sys
from pathlib import Path

import deepspeed

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
if sys.argv[-1] == "raise-on-1":
    from mpi4py import MPI
    if rank == 1:
        raise RuntimeError("the script failed on rank 1")
    MPI.COMM_WORLD.Barrier()  # waits for rank 1 for ever, unless the runner aborts the job
from accelerate.state import PartialState

(out / f"rank{rank}.json").write_text(json.dumps({
    "deepspeed": deepspeed.__name__, "argv": sys.argv, "path0": sys.path[0], "name": __name__,
    "accelerate": bool(getattr(PartialState._prepare_backend, "zerompi", False))}))
