"""``deepspeed.runtime.lr_schedules``: the names of DeepSpeed's schedules, where accelerate and
transformers look them up (``VALID_LR_SCHEDULES``: a config's ``scheduler.type`` among them is built
by the engine, not by the framework). zerompi builds WarmupLR, WarmupDecayLR and WarmupCosineLR
(lr_schedules.py); the config refuses the other two by name."""
from __future__ import annotations

LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
