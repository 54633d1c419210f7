"""torch.distributed under plain mpiexec after deepspeed.init_distributed(): the default process
group runs over MPI (no rendezvous), and every collective a script calls gives torch's answer.
Raises on the first wrong answer; rank 0 writes the backend's name and the environment to --out."""
import argparse
import json
import os
import warnings

import torch
import torch.distributed as dist

import zerompi.deepspeed as deepspeed

warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renamed *_into_tensor / *_tensor
p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

assert not dist.is_initialized()
deepspeed.init_distributed()
deepspeed.init_distributed()  # a second call changes nothing
r, n = dist.get_rank(), dist.get_world_size()
assert (r, n) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])), (r, n)
assert os.environ["LOCAL_WORLD_SIZE"] == os.environ["LOCAL_SIZE"]
dist.barrier()

t = torch.tensor([float(r + 1), 2.0])
dist.all_reduce(t)
assert t.tolist() == [n * (n + 1) / 2, 2.0 * n], t
t = torch.tensor([r + 1])
dist.all_reduce(t, op=dist.ReduceOp.MAX)
assert t.item() == n and t.dtype == torch.int64
t = torch.tensor([float(r)])
dist.all_reduce(t, op=dist.ReduceOp.AVG)
assert t.item() == (n - 1) / 2, t
t = torch.full((3,), float(r))
dist.broadcast(t, src=n - 1)
assert t.tolist() == [n - 1.0] * 3
outs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
dist.all_gather(outs, torch.tensor([r, 10 * r]))
assert [o.tolist() for o in outs] == [[i, 10 * i] for i in range(n)]
big = torch.empty(n * 2)
dist.all_gather_into_tensor(big, torch.tensor([float(r), 1.0]))
assert big.tolist() == sum(([float(i), 1.0] for i in range(n)), [])
objs = [None] * n
dist.all_gather_object(objs, {"r": r})
assert objs == [{"r": i} for i in range(n)]
lst = [r]
dist.broadcast_object_list(lst, src=0)
assert lst == [0]
work = dist.all_reduce(torch.ones(1), async_op=True)
work.wait()
o = torch.empty(2)
dist.reduce_scatter_tensor(o, torch.arange(2.0 * n))
assert o.tolist() == [n * 2.0 * r, n * (2.0 * r + 1)], o
x = torch.arange(float(n)) + 10 * r
y = torch.empty(n)
dist.all_to_all_single(y, x)
assert y.tolist() == [10.0 * i + r for i in range(n)], y
g = [torch.empty(1) for _ in range(n)] if r == 0 else None
dist.gather(torch.tensor([float(r)]), g, dst=0)
assert r != 0 or [v.item() for v in g] == list(range(n))
s = torch.empty(1)
dist.scatter(s, [torch.tensor([float(i * i)]) for i in range(n)] if r == 0 else None, src=0)
assert s.item() == r * r
t = torch.tensor([2.0])
dist.reduce(t, dst=0, op=dist.ReduceOp.PRODUCT)
assert r != 0 or t.item() == 2.0 ** n
sub = dist.new_group([0, 1])  # made by ranks 0 and 1 alone
if r < 2:
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t, group=sub)
    assert t.item() == 3.0
assert deepspeed.comm.get_rank(group=dist.group.WORLD) == r  # deepspeed.comm takes torch's world group
t = torch.tensor([1.0])
deepspeed.comm.all_reduce(t)  # and shares the communicator: interleaved calls stay in order
assert t.item() == n
if r == 0:
    with open(args.out, "w") as f:
        json.dump(dict(backend=dist.get_backend(), world=n, master=os.environ.get("MASTER_PORT")), f)
dist.destroy_process_group()
