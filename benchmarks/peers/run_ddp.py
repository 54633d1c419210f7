"""torch DDP, alone or with ZeroRedundancyOptimizer: one benchmark row (see rowlib).

``--variant ddp``: DistributedDataParallel + torch.optim.AdamW.
``--variant zero_opt``: the same with the AdamW state sharded by
torch.distributed.optim.ZeroRedundancyOptimizer (each rank updates its
partition and broadcasts it).
"""
from __future__ import annotations

import commcount
import rowlib
import torch


def build(model, args, comm) -> rowlib.Trainer:
    commcount.install()
    rowlib.init_torch_distributed(comm)
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    if args.trace:  # the same bucket all-reduces, through Python, so that calltrace sees each bucket
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    kwargs = dict(lr=args.lr, betas=rowlib.BETAS, eps=rowlib.EPS, weight_decay=args.weight_decay)
    if args.variant == "zero_opt":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **kwargs)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), **kwargs)

    n, psi = comm.Get_size(), sum(p.numel() for p in model.parameters())
    allreduce = 2 * (n - 1) * psi * 4 // n  # DDP all-reduces every fp32 gradient once per step
    return rowlib.Trainer(step=rowlib.torch_step(ddp, opt), bytes_sent=commcount.bytes_sent,
                          implicit_bytes_per_step=allreduce,
                          info=dict(bucket_cap_mb=args.bucket_mb))


if __name__ == "__main__":
    rowlib.main(build, variants=("ddp", "zero_opt"))
