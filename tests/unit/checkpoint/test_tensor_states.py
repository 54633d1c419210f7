"""Whole-tensor optimizer state in checkpoints (zerompi/checkpoint/tensors.py): a damaged, missing or
malformed record or dataset is refused by name on every rank, and the engine keeps what it had."""
from __future__ import annotations

import math

import h5py
import pytest
import torch

from tests.unit.optim import test_whole as w
from tests.unit.optim.loop import train
from zerompi.checkpoint import schema, tensors
from zerompi.checkpoint.index import CheckpointIndex
from zerompi.comm.local import run_ranks
from zerompi.errors import CheckpointError

GOOD = {"rank": 1, "offset": 0, "shapes": {"row_var": [40, 1], "step": []},
        "dtypes": {"row_var": "float32", "step": "float32"}}


@pytest.mark.parametrize("record,named", [
    ([1, 2], r"tensor_states\['w'\] is \[1, 2\]"),
    ({**GOOD, "rank": 2}, r"\['rank'\] = 2 is not a rank of the 2"),
    ({**GOOD, "rank": True}, r"\['rank'\] = True"),
    ({**GOOD, "offset": -1}, r"\['offset'\] = -1 is not an offset"),
    ({**GOOD, "shapes": {"row_var": [40, -1], "step": []}}, r"\['shapes'\]\['row_var'\] = \[40, -1\] is not a shape"),
    ({**GOOD, "shapes": {"row_var": [40, 1]}}, r"must name the same states"),
    ({**GOOD, "dtypes": {"row_var": "object", "step": "float32"}}, r"\['dtypes'\]\['row_var'\] = 'object'"),
    ({**GOOD, "extra": 1}, r"not \{'rank', 'offset', 'shapes', 'dtypes'\}"),
])
def test_a_malformed_record_is_refused_naming_its_field(record, named):
    assert tensors.checked({"w": GOOD}, 2) == {"w": GOOD}
    with pytest.raises(CheckpointError, match=named):
        tensors.checked({"w": record}, 2)
    with pytest.raises(CheckpointError, match="is not a dict"):
        tensors.checked([GOOD], 2)


def _save(tmp_path) -> None:
    def rank(group):
        engine = w._engine(group, 2, "adafactor")
        train(engine, range(2))
        engine.save_checkpoint(tmp_path, "good")
        engine.close()
    run_ranks(2, rank)


def _damage(tmp_path, how: str) -> str:
    """Damage the saved row_var of the first matrix in its writer's file; the dataset's name."""
    index = CheckpointIndex.read(tmp_path / "good" / schema.INDEX)
    record = next(r for r in index.optimizer["tensor_states"].values() if "row_var" in r["shapes"])
    at = record["offset"] + sum(math.prod(s) for k, s in record["shapes"].items() if k < "row_var")  # by name
    with h5py.File(tmp_path / "good" / schema.rank_file(record["rank"]), "r+") as f:
        if how == "missing":
            del f[schema.TENSOR_STATES]
        else:
            f[schema.TENSOR_STATES][at] = f[schema.TENSOR_STATES][at] + 1.0
    return schema.TENSOR_STATES


@pytest.mark.parametrize("how", ["flip", "missing"])
def test_a_damaged_tensor_state_is_refused_and_the_engine_keeps_its_own(tmp_path, how):
    _save(tmp_path)
    dataset = _damage(tmp_path, how)

    def rank(group):
        engine = w._engine(group, 2, "adafactor")
        train(engine, range(1))
        before = {k: v.clone() for k, v in engine.full_state_dict().items()}
        with pytest.raises(CheckpointError, match=dataset.replace("/", ".") if how == "missing" else "checksum|CRC"):
            engine.load_checkpoint(tmp_path, "good")
        after = engine.full_state_dict()
        engine.close()
        assert all(torch.equal(before[k], after[k]) for k in before)
    run_ranks(3, rank)


def test_state_held_only_per_tensor_is_still_refused_by_another_optimizer(tmp_path):
    """Adafactor on every tensor keeps no per-element state in the buckets: its checkpoint still names
    its optimizer to a job that runs AdamW."""
    _save(tmp_path)

    def rank(group):
        net = w._net()
        engine = w.zerompi.initialize(net, w.ZeroConfig(stage=2, **w.CFG), group=group)
        with pytest.raises(CheckpointError, match="param group 0 was written by torch.optim.Adafactor, this job runs torch.optim.adamw.AdamW"):
            engine.load_checkpoint(tmp_path, "good")
        engine.close()
    run_ranks(2, rank)
