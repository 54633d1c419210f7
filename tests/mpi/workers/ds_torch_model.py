"""The model and data of workers/ds_torch_script.py, and its single-process reference.

The model answers as transformers' models do: ``model(x, y)`` returns ``{"loss", "pred"}``, the
loss computed from the prediction, so a script's ``out["loss"].backward()`` reaches both outputs.
``python ds_torch_model.py --out ref.json --world 2`` trains it with plain torch on each step's
global batch, whole (``loss_ref``) and in the ranks' micro-batches (``loss_alt``).
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

STEPS, MICRO, ACCUM, LR, CLIP = 8, 4, 2, 0.02, 1.0
CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
          "steps_per_print": 1000, "wall_clock_breakdown": False,
          "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False}}
WEIGHTS = torch.linspace(-0.5, 0.5, 8).unsqueeze(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x, y=None):
        pred = self.body(x)
        return pred if y is None else {"loss": F.mse_loss(pred, y), "pred": pred}


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def make_scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.2 * k))


def micro_batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(MICRO, 8, generator=g)
    return x, x @ WEIGHTS


def reference(world: int) -> dict:
    from reference_step import reference_step
    from zerompi.optim.optimizer import default_kernel  # the engine's kernel
    out = {}
    for name, chunked in (("loss_ref", False), ("loss_alt", True)):
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01,
                                **default_kernel(torch.optim.AdamW, "cpu"))
        sched = make_scheduler(opt)
        losses, lrs = [], []
        for step in range(STEPS):
            lrs.append(opt.param_groups[0]["lr"])
            parts = [micro_batch(step, r, m) for r in range(world) for m in range(ACCUM)]
            losses.append(reference_step(model, opt, sched, parts, chunked, CLIP))
        out[name], out["lrs"] = losses, lrs
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--config", help="also write the DeepSpeed config here")
    a = p.parse_args()
    with open(a.out, "w") as f:
        json.dump(reference(a.world), f)
    if a.config:
        with open(a.config, "w") as f:
            json.dump(CONFIG, f)
