"""``deepspeed.moe``: what a script imports from it, without experts.

zerompi has no mixture-of-experts layer and no expert parallelism. ``layer.MoE`` raises when
built, naming why; ``utils`` groups parameters as DeepSpeed does, which for a model without
expert parameters (none carries DeepSpeed's ``allreduce = False`` mark) leaves the groups as
they are, so a script that imports or calls it on a dense model runs unchanged.
"""
from zerompi.compat.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
