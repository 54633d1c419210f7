"""``deepspeed.runtime``: the few names under DeepSpeed's runtime package that scripts import (runtime/zero)."""
from zerompi.compat.deepspeed.runtime import zero  # noqa: F401  (deepspeed.runtime.zero.<name> by attribute)
