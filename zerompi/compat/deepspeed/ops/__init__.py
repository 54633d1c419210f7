"""``deepspeed.ops``: the optimizer classes scripts construct (adam.py)."""
from zerompi.compat.deepspeed.ops import adam

__all__ = ["adam"]
