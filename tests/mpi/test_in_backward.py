"""optimizer_in_backward on real ranks (workers/in_backward.py): each bucket is updated during the
backward that ends its window, as soon as its gradient is reduced.

The update is the same arithmetic as step()'s, so parameters, losses and the reported gradient norm
must be bitwise equal to a run without the option, for stages 2-3, offload none/cpu/nvme, fp32 and
bf16, accumulation, overlapped reduce-scatters, frozen parameters and prefetch, at an even and an
uneven world size. Under NVMe offload the gradient shard no longer goes through the swap file.
"""
from __future__ import annotations

import pytest

from .launcher import run_worker_json


@pytest.fixture(scope="module", params=(2, 3), ids=lambda n: f"np{n}")
def result(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"in_backward{request.param}")
    swap = base / "swap"
    swap.mkdir()
    return run_worker_json(request.param, "in_backward.py", base / "r.json", "--swap", str(swap))


def _id(row):
    return f"stage{row['stage']}-{row['dtype']}-{row['mode']}-accum{row['accum']}" + \
        ("-overlap" if row["overlap"] else "") + ("-frozen" if row["frozen"] else "")


def test_bitwise_equal_to_the_update_in_step(result):
    assert len(result["rows"]) == 13
    for row in result["rows"]:
        assert row["trained"], _id(row)
        assert row["params_equal"], _id(row)
        assert row["losses"][0] == row["losses"][1], (_id(row), row["losses"])
        assert row["norms"][0] == row["norms"][1] and row["norms"][0] > 0, (_id(row), row["norms"])


def test_nvme_gradients_skip_the_swap_file(result):
    for row in result["rows"]:
        if row["mode"] != "nvme":
            assert row["traffic"] == [[0, 0], [0, 0]], _id(row)
            continue
        (read, written), (read_ib, written_ib) = row["traffic"]
        # one micro-batch: the gradient shard is neither written nor read back; two: the first
        # micro-batch's shard still waits in the file for the second
        assert written_ib < written and read_ib < read, (_id(row), row["traffic"])


def test_a_save_between_backward_and_step_is_refused(result):
    message = result["refusals"]["save"]
    assert "optimizer_in_backward" in message and "call step() first" in message, message


def test_a_nan_gradient_still_raises_and_says_what_was_updated(result):
    message = result["refusals"]["nan"]
    assert message.startswith("non-finite") and "optimizer_in_backward had updated" in message, message


def test_a_failed_backward_keeps_its_updates_and_training_goes_on(result):
    a = result["abandoned"]
    assert a["buckets"] >= 2 and "failed on purpose" in a["error"], a
    assert a["pending_after"] == 0 and a["stepped"] is True, a
    # backward reached the last layer's bucket before the first layer's raised: only it was updated
    assert a["changed"] == ["b.bias", "b.weight"], a


def test_swap_files_are_removed(result):
    assert result["left_behind"] == []
