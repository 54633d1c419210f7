"""DeepSpeed's training-script API over zerompi: ``import zerompi.deepspeed as deepspeed``.

The public name of zerompi/compat/deepspeed/shim.py (this module *is* that one, so its
names, documented there, stay the same objects under both names).
"""
import sys

from zerompi.compat.deepspeed import shim

sys.modules[__name__] = shim
