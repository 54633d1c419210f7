"""Everything DeepSpeed, in one package: config translation, "auto", batch keys, schedules, the script shim.

- config.py: ``config_from(ds_config)`` and ``translate_config``, key by key (what
  zerompi lacks is refused, never ignored); keys.py holds the key tables, old spellings and
  refusal reasons, screen.py applies them, swap.py maps the offload and aio keys; auto.py
  resolves "auto" values, batch.py
  the batch keys, schedule.py reads a scheduler block and lr_schedules.py runs it as
  DeepSpeed's own formulas.
- shim.py: DeepSpeed's training-script API over zerompi, public as ``zerompi.deepspeed``.

Importing this package registers DeepSpeed JSON as a config dialect (config/dialects.py).
"""
from zerompi.compat.deepspeed.config import DeepSpeedDialect, config_from, looks_like_deepspeed, translate_config
from zerompi.compat.deepspeed.lr_schedules import scheduler_factory
from zerompi.compat.deepspeed.shim import DeepSpeedEngine, add_config_arguments, init_distributed, initialize
from zerompi.config import dialects

dialects.register(DeepSpeedDialect())

__all__ = ["DeepSpeedEngine", "add_config_arguments", "config_from", "init_distributed", "initialize",
           "looks_like_deepspeed", "scheduler_factory", "translate_config"]
