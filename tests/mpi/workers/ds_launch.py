"""Run a DeepSpeed script unchanged under real DeepSpeed and plain mpiexec: what DeepSpeed's
launcher would give it (ds_env.py: rank, size, a free port, gloo on CPU), then the script."""
import logging
import runpy
import sys

from ds_env import deepspeed_env, exit_past_destructors

deepspeed_env()
import deepspeed  # noqa: E402

deepspeed.utils.logger.setLevel(logging.WARNING)
script, *rest = sys.argv[1:]
sys.argv = [script, *rest]
runpy.run_path(script, run_name="__main__")
exit_past_destructors()
