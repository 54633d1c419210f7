"""Optimizers that see whole tensors under real MPI (tests/mpi/test_whole_tensor.py), in one job:
- Muon + AdamW and Adafactor with reproducible=True at stages 0-3: a SHA-256 of each trained tensor;
- Muon + AdamW in the default mode at stages 1-3: each tensor's largest difference from the plain loop
  (relative to its largest value), and the bytes of a step's collectives beside AdamW's on the same model;
- the counted collectives themselves (tests/unit/comm/test_local_group.py's checks, over MPIGroup)."""
import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: the unit tests' model and loop
import zerompi  # noqa: E402
from zerompi.config import ZeroConfig  # noqa: E402

from tests.unit.comm.test_local_group import counted_failures  # noqa: E402
from tests.unit.optim import loop  # noqa: E402
from tests.unit.optim import test_whole as w  # noqa: E402
from zerompi.comm.mpi import MPIGroup  # noqa: E402


def digests(state) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest() for k, v in state.items()}


def default_mode(stage: int) -> dict:
    """Muon + AdamW without reproducible=True, and AdamW alone: errors and a step's bytes per kind."""
    out = {"mode": "default", "stage": stage}
    for groups in (w._muon_groups, None):
        net = w._net()
        engine = zerompi.initialize(net, ZeroConfig(stage=stage, **{**w.CFG, "reproducible": False}),
                                    param_groups=groups(net) if groups else None)
        loop.train(engine, range(1))
        before = dict(engine.group.bytes_sent)
        loop.train(engine, range(1, w.STEPS))
        sent = {k: v - before.get(k, 0) for k, v in engine.group.bytes_sent.items()}
        out["bytes_muon" if groups else "bytes_adamw"] = engine.group.allgather_object(sent)
        got = engine.full_state_dict() if groups else None  # collective
        if groups and engine.rank == 0:
            want = w._plain("muon+adamw", w.STEPS)
            out["errors"] = {k: float((got[k] - want[k]).abs().max()) / float(want[k].abs().max()) for k in want}
        out["world"] = engine.world_size
        engine.close()
    return out


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
            rows.append({"mode": mode, "stage": stage, "world": engine.world_size, "digests": digests(state)})
            engine.close()
    rows += [default_mode(stage) for stage in (1, 2, 3)]
    group = MPIGroup()
    rows.append({"mode": "counted", "stage": None, "world": group.size,
                 "failures": sum(group.allgather_object(counted_failures(group)), [])})
    if rows and group.rank == 0:
        Path(a.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
