"""Stage 3 between gathers, what a user reaches for: printing a parameter, summing it, copying the module's
state_dict, torch.save of it, a model summary's count. Each parameter keeps its shape over one NaN element
(shard/bucket.py), so all of that answers (NaN values, the true shapes and counts) where a view of the freed
storage would read unmapped memory and kill the process with SIGSEGV. In a fresh interpreter, so that a
crash is a failed test, not a lost run; training afterwards must give the plain loop's parameters bitwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = """
import copy, io, json, torch, zerompi
from mpi4py import MPI
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
plain = copy.deepcopy(model)
cfg = zerompi.ZeroConfig(stage=3, lr=0.1, optimizer="sgd", weight_decay=0.0, bucket_mb=32 * 4 / 2**20, clip_grad_norm=None)
engine = zerompi.initialize(model, cfg, comm=MPI.COMM_SELF)
w = model[0].weight
got = {"shape": list(w.shape), "numel": sum(p.numel() for p in model.parameters()),
       "sum_nan": bool(torch.isnan(w.sum())), "repr": "nan" in repr(w), "clone": list(w.detach().clone().shape)}
state = model.state_dict()
buf = io.BytesIO()
torch.save(state, buf)
got["saved"] = buf.tell() > 0 and all(list(v.shape) == list(p.shape) for v, p in zip(state.values(), plain.parameters()))
try:
    with torch.no_grad():
        w.add_(1)
    got["write"] = "allowed"
except RuntimeError as e:
    got["write"] = str(e).split(".")[0]
sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
x, y = torch.randn(5, 4), torch.randn(5, 3)
for _ in range(2):
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    sgd.zero_grad()
    nn.functional.mse_loss(plain(x), y).backward()
    sgd.step()
full = engine.full_state_dict()
got["trained"] = all(torch.equal(full[n], p.detach()) for n, p in plain.named_parameters())
engine.close()
print(json.dumps(got))
"""


def test_stage3_parameters_read_between_gathers_are_nan_of_their_shape():
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, f"exit {proc.returncode} (-11: SIGSEGV)\n{proc.stderr[-3000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["shape"] == [8, 4] and got["numel"] == 8 * 4 + 8 + 8 * 3 + 3 and got["clone"] == [8, 4], got
    assert got["sum_nan"] and got["repr"] and got["saved"], got
    assert got["write"].startswith("unsupported operation: more than one element of the written-to tensor"), got
    assert got["trained"], "the engine's parameters after 2 steps differ from the plain loop's"
