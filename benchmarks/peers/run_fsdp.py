"""FSDP2 ``fully_shard`` on CPU: one benchmark row (see rowlib).

Each transformer block is a unit, the root takes the rest (embeddings, final
LayerNorm). ``--variant reshard``: parameters are freed after the forward and
all-gathered again for the backward (ZeRO-3); ``noreshard`` keeps them from
forward to backward (ZeRO-2-like traffic, ZeRO-3 memory between steps).
"""
from __future__ import annotations

import commcount
import rowlib
import torch


def build(model, args, comm) -> rowlib.Trainer:
    commcount.install()
    rowlib.init_torch_distributed(comm)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (comm.Get_size(),))  # on CPU the mesh must be explicit
    reshard = args.variant == "reshard"
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=rowlib.BETAS, eps=rowlib.EPS,
                            weight_decay=args.weight_decay)

    return rowlib.Trainer(step=rowlib.torch_step(model, opt), bytes_sent=commcount.bytes_sent,
                          info=dict(reshard_after_forward=reshard, units=len(model.transformer.h) + 1))


if __name__ == "__main__":
    rowlib.main(build, variants=("reshard", "noreshard"))
