"""Optimizers that see whole tensors on CUDA tensors (tests/gpu/test_gpu_whole.py): Muon + AdamW and
Adafactor with reproducible=True at stages 0-3, two ranks sharing one GPU, and rank 0's plain
single-process loop (tests/unit/optim/loop.py) on the same GPU; rank 0 writes, per row, the tensors whose
bits differ. The owner-aligned buckets' counted collectives (Allgatherv, Reduce_scatter, Alltoallv) meet
device buffers staged through host memory (cuda_aware_mpi='off') or handed to MPI ('on')."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: the unit tests' model and loop
import torch  # noqa: E402

import zerompi  # noqa: E402
from zerompi.config import ZeroConfig  # noqa: E402
from zerompi.errors import ConfigError  # noqa: E402

from gpu_common import parser, setup  # noqa: E402
from tests.unit.optim import loop  # noqa: E402
from tests.unit.optim import test_whole as w  # noqa: E402


def main() -> None:
    p = parser(__doc__, steps=False)
    p.add_argument("--cuda-aware", default="off")
    a = p.parse_args()
    device = setup(a.device)
    rows, rank = [], 0
    for mode, (changes, groups, reference) in w.MODES.items():
        for stage in range(4):
            net = w._net().to(device)
            cfg = {**w.CFG, **changes, "device": device.type, "cuda_aware_mpi": a.cuda_aware}
            try:
                engine = zerompi.initialize(net, ZeroConfig(stage=stage, **cfg),
                                            param_groups=groups(net) if groups else None)
            except ConfigError as e:  # cuda_aware_mpi='on' where MPI reports no CUDA support
                rows = {"skipped": str(e)}
                break
            loop.train(engine, range(w.STEPS))
            got, rank = engine.full_state_dict(), engine.rank
            if rank == 0:
                plain = w._net().to(device)
                want = loop.plain(plain, reference(plain), w.STEPS)
                rows.append({"mode": mode, "stage": stage, "device": str(got[next(iter(got))].device.type),
                             "differ": sorted(k for k in want if not torch.equal(got[k].to(device), want[k]))})
            engine.close()
        if isinstance(rows, dict):
            break
    if rank == 0:
        Path(a.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
