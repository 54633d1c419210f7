"""Run a DeepSpeed script unchanged under real DeepSpeed and plain mpiexec: what DeepSpeed's
launcher would give it (ds_env.py: rank, size, a free port, gloo on CPU), then the script."""
import logging
import os
import runpy
import sys

from ds_env import deepspeed_env

deepspeed_env()
import deepspeed  # noqa: E402

deepspeed.utils.logger.setLevel(logging.WARNING)
script, *rest = sys.argv[1:]
sys.argv = [script, *rest]
runpy.run_path(script, run_name="__main__")
# DeepSpeed 0.19.8 on gloo now and then aborts in a destructor at exit ("terminate called without an active
# exception", about 1 run in 20 here), after the script has finished and written what it writes: MPI is
# finalised as at any exit, and the process ends before those destructors run.
from mpi4py import MPI  # noqa: E402

sys.stdout.flush()
sys.stderr.flush()
MPI.Finalize()
os._exit(0)
