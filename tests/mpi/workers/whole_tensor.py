"""Optimizers that see whole tensors under real MPI (tests/mpi/test_whole_tensor.py): Muon + AdamW and
Adafactor with reproducible=True at stages 0-3 in one job; rank 0 writes a SHA-256 of each trained tensor."""
import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: the unit tests' model and loop
import zerompi  # noqa: E402
from zerompi.config import ZeroConfig  # noqa: E402

from tests.unit.optim import loop  # noqa: E402
from tests.unit.optim import test_whole as w  # noqa: E402


def digests(state) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest() for k, v in state.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rows = []
    for mode, (changes, groups, _) in w.MODES.items():
        for stage in range(4):
            net = w._net()
            engine = zerompi.initialize(net, ZeroConfig(stage=stage, **{**w.CFG, **changes}),
                                        param_groups=groups(net) if groups else None)
            loop.train(engine, range(w.STEPS))
            state = engine.full_state_dict()
            if engine.rank == 0:
                rows.append({"mode": mode, "stage": stage, "world": engine.world_size, "digests": digests(state)})
            engine.close()
    if rows:
        Path(a.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
