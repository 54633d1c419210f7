"""An Accelerate training loop with ``DeepSpeedPlugin(zero_stage=S)`` as users write it (``prepare``,
``accumulate``, ``accelerator.backward``), for benchmarks/frameworks_vs_deepspeed.py: under
``python -m zerompi.deepspeed`` a zerompi run, under ds_frameworks_launch.py a real DeepSpeed one.

``from_pretrained(--model_dir)``, AdamW, 64 fixed token rows in order (2 per micro-batch per rank,
accumulation 2). Rank 0 writes each optimizer step's loss (the window's micro-batch losses averaged over the
window and the ranks) as JSON to ``--out``.
"""
import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model_dir", required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    plugin = DeepSpeedPlugin(zero_stage=a.stage, gradient_accumulation_steps=2, gradient_clipping=1.0)
    acc = Accelerator(deepspeed_plugin=plugin)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = torch.randint(0, model.config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses, window = [], []
    while len(losses) < a.steps:
        for batch in loader:
            with acc.accumulate(model):
                loss = model(**batch).loss
                window.append(loss.detach())
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            if acc.sync_gradients:
                losses.append(float(acc.reduce(torch.stack(window).mean(), "mean")))
                window = []
                if len(losses) == a.steps:
                    break
    if acc.is_main_process:
        with open(a.out, "w") as f:
            json.dump(dict(losses=losses, world=acc.num_processes), f)


if __name__ == "__main__":
    main()
