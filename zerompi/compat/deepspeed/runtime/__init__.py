"""``deepspeed.runtime``: the few names under DeepSpeed's runtime package that scripts and frameworks
import (runtime/zero, runtime/lr_schedules)."""
from zerompi.compat.deepspeed.runtime import lr_schedules, zero  # noqa: F401  (deepspeed.runtime.<name> by attribute)
