"""Under the runner (python -m zerompi.deepspeed), a gloo group built the way frameworks build one on the CPU
(torch.distributed.init_process_group("gloo"), env://), with no variable from the user: MASTER_ADDR and
MASTER_PORT come from the runner. Rank 0 writes what each rank saw and the sum of an all_reduce."""
import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")})
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"sum": t.item(), "rows": rows}, f)
dist.destroy_process_group()
