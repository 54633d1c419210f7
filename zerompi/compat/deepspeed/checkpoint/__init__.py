"""``deepspeed.checkpoint``: the helper transformers' Trainer imports when it saves (checkpoint/utils)."""
from zerompi.compat.deepspeed.checkpoint import utils  # noqa: F401  (deepspeed.checkpoint.utils by attribute)
