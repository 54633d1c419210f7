"""``deepspeed.compression``: only ``helper``'s two attribute helpers, which LoRA code imports from it. DeepSpeed's
compression itself (quantisation-aware training, pruning, layer reduction) is not in zerompi."""
from zerompi.compat.deepspeed.compression import helper  # noqa: F401
