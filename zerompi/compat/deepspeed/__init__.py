"""Everything DeepSpeed, in one package, public as ``zerompi.deepspeed``.

- config.py: ``config_from(ds_config)`` and ``translate_config``, key by key (what
  zerompi lacks is refused, never ignored); keys.py holds the key tables, old spellings and
  refusal reasons, screen.py applies them, swap.py maps the offload and aio keys; auto.py
  resolves "auto" values, batch.py
  the batch keys, schedule.py reads a scheduler block and lr_schedules.py runs it as
  DeepSpeed's own formulas.
- shim.py: ``initialize`` and ``add_config_arguments``; engine.py the engine object it
  returns (timer.py its ``tput_timer``); client.py what the script builds itself (optimizer,
  scheduler, dataset); launcher_env.py the ``RANK``/``LOCAL_RANK``/... that ``import
  zerompi.deepspeed`` sets from the MPI launcher's variables.
- The package surface scripts import: ``accelerator`` (``get_accelerator()``), ``comm``
  (``import deepspeed.comm as dist``), ``ops.adam`` (FusedAdam, DeepSpeedCPUAdam),
  ``zero`` (Init, GatheredParameters), ``utils`` (logger, log_dist), ``checkpointing``
  (activation checkpointing), ``get_accelerator`` at the top as in DeepSpeed, and two names scripts import from
  packages zerompi otherwise lacks: ``runtime.zero.partition_parameters.ZeroParamStatus`` and
  ``compression.helper`` (recursive_getattr/setattr).

``__version__`` is the DeepSpeed release whose API this follows, marked as zerompi's
(``0.19.8+zerompi.<zerompi version>``), so version checks in scripts read a DeepSpeed number.
Importing this package registers DeepSpeed JSON as a config dialect (config/dialects.py).
"""
from importlib import metadata

from zerompi.compat.deepspeed import accelerator, checkpointing, comm, compression, moe, ops, runtime, utils, zero
from zerompi.compat.deepspeed.accelerator import get_accelerator
from zerompi.compat.deepspeed.comm import init_distributed
from zerompi.compat.deepspeed.config import DeepSpeedDialect, config_from, looks_like_deepspeed, translate_config
from zerompi.compat.deepspeed.engine import DeepSpeedEngine
from zerompi.compat.deepspeed.lr_schedules import scheduler_factory
from zerompi.compat.deepspeed.shim import add_config_arguments, initialize
from zerompi.config import dialects

dialects.register(DeepSpeedDialect())

DEEPSPEED_API = "0.19.8"
"""The DeepSpeed release whose training-script API this package follows."""
try:
    __version__ = f"{DEEPSPEED_API}+zerompi.{metadata.version('zerompi')}"
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = f"{DEEPSPEED_API}+zerompi"

__all__ = ["DEEPSPEED_API", "DeepSpeedEngine", "accelerator", "add_config_arguments", "checkpointing", "comm",
           "compression", "config_from", "get_accelerator", "init_distributed", "initialize", "looks_like_deepspeed",
           "moe", "ops", "runtime", "scheduler_factory", "translate_config", "utils", "zero", "__version__"]
