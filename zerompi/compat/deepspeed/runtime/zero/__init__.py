"""``deepspeed.runtime.zero``: ``partition_parameters.ZeroParamStatus``, imported by scripts that test a parameter's
ZeRO-3 status."""
from zerompi.compat.deepspeed.runtime.zero import partition_parameters  # noqa: F401
