"""``deepspeed.checkpoint.utils``: what the Trainer calls on a state dict before ``torch.save``."""
from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor replaced by a copy of its own on ``device`` (DeepSpeed's: a view would
    save the whole storage it shares), through dicts, lists and tuples."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return {k: clone_tensors_for_torch_save(v, device) for k, v in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item
