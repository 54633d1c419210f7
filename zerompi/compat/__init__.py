"""Other frameworks' dialects over zerompi, kept at the edge: the engine and the config know none.

``zerompi.compat.deepspeed``: DeepSpeed JSON configs (translated key by key, "auto"
values, batch keys, scheduler blocks) and DeepSpeed's training-script API
(``import zerompi.deepspeed as deepspeed``). Importing ``zerompi`` registers the
DeepSpeed config dialect, so ``ZeroConfig.from_file`` reads DeepSpeed JSON too.
"""
from zerompi.compat import deepspeed

__all__ = ["deepspeed"]
