"""An Accelerate training loop as users write it (``Accelerator``, ``prepare``, ``accumulate``,
``accelerator.backward``), for tests/mpi/test_hf_trainer.py. ``--stage S`` passes a
``DeepSpeedPlugin(zero_stage=S)``: under ``python -m zerompi.deepspeed`` that is a zerompi run (``--from-launch``:
no plugin in the script, the settings come from the runner's ``--accelerate_config``); without it,
one plain process accumulating ``--accum`` micro-batches is the reference. The tiny GPT-2 of
hf_trainer.py, 64 fixed token rows in order; rank 0 saves the final weights (safetensors) to ``--out``.
"""
import argparse

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from safetensors.torch import save_file
from transformers import GPT2LMHeadModel

from hf_trainer import Tokens, tiny_gpt2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--from-launch", action="store_true",
                   help="Accelerator() alone: its DeepSpeed settings come from the launch (accelerate config's yaml)")
    a = p.parse_args()
    if a.from_launch:
        acc = Accelerator()
    elif a.stage is None:
        acc = Accelerator(gradient_accumulation_steps=a.accum)
    else:
        plugin = DeepSpeedPlugin(zero_stage=a.stage, gradient_accumulation_steps=a.accum, gradient_clipping=1.0,
                                 offload_optimizer_device="cpu" if a.offload else "none",
                                 zero3_save_16bit_model=True)
        acc = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=a.micro)
    model, opt, loader = acc.prepare(model, opt, loader)
    for batch in loader:
        with acc.accumulate(model):
            acc.backward(model(**batch).loss)
            if acc.sync_gradients and a.stage is None:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, a.out)


if __name__ == "__main__":
    main()
