"""16-bit exports of an engine's model: the whole model in the compute dtype, gathered from every rank
(``save_16bit`` as safetensors, ``state_dict_16bit`` as tensors); the DeepSpeed engine's
``save_16bit_model`` and ``module_state_dict`` call them. It sits above the engine it reads, beside it,
not in checkpoint/ (which the engine imports)."""
from __future__ import annotations

from pathlib import Path

import torch

from zerompi.checkpoint import safetensors
from zerompi.engine import Engine
from zerompi.errors import UsageError, all_ranks_ok


def check_name(save_filename: str) -> None:
    """Refuse a file name that is not safetensors' (no pickle is ever written)."""
    if Path(save_filename).suffix != ".safetensors":
        raise UsageError(f"save_16bit_model(save_filename={save_filename!r}): zerompi writes safetensors, "
                         "never pickles; use a name ending in .safetensors (transformers loads "
                         "model.safetensors)")


def save_16bit(engine: Engine, save_dir, save_filename: str = "model.safetensors",
               exclude_frozen_parameters: bool = False) -> None:
    """Collective: rank 0 writes every parameter (tied ones once; the trainable ones alone with
    ``exclude_frozen_parameters``) and persistent buffer, whole, in the compute dtype, as
    safetensors under ``save_dir`` (no pickle: a ``.bin`` name is refused)."""
    check_name(save_filename)
    full = engine.full_state_dict()  # collective: fp32, every rank
    dtype = engine.config.precision.torch_dtype
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    tensors = {n: t.to(dtype) for n, t in full.items() if not (exclude_frozen_parameters and n in frozen)}
    keep = set(engine.module.state_dict(keep_vars=True))  # persistent buffers (no data is read)
    tensors.update({n: b.detach().cpu() for n, b in engine.module.named_buffers() if n in keep})
    error = None
    if engine.rank == 0:
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            entries = [safetensors.Entry(n, tuple(t.shape), safetensors.CODES[str(t.dtype).removeprefix("torch.")])
                       for n, t in tensors.items()]
            safetensors.write(Path(save_dir) / save_filename, entries,
                              lambda n: memoryview(tensors[n].reshape(-1).contiguous().view(torch.uint8).numpy()).cast("B"))
        except (OSError, KeyError) as e:
            error = f"save_16bit_model: {type(e).__name__}: {e}"
    all_ranks_ok(engine.group, error)


def state_dict_16bit(engine: Engine, prefix: str = "", exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """Collective: the module's state dict with every parameter whole (gathered at stage 3) in the
    compute dtype, on the CPU, and its persistent buffers; ``exclude_frozen_parameters`` leaves
    the frozen ones out."""
    full = engine.full_state_dict()
    dtype = engine.config.precision.torch_dtype
    named = {id(p): n for n, p in engine.module.named_parameters()}  # a tied parameter's first name
    out = {}
    for name, value in engine.module.state_dict(keep_vars=True).items():  # its order, tied names included
        if id(value) not in named:  # a buffer
            out[prefix + name] = value.detach().cpu().clone()
        elif not (exclude_frozen_parameters and not value.requires_grad):
            out[prefix + name] = full[named[id(value)]].to(dtype)
    return out
