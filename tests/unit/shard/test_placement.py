"""zerompi.shard.placement: one record per parameter, the persistence threshold compared once."""
from __future__ import annotations

import pytest

from zerompi.shard.placement import ParamPlacement, Residence, place
from zerompi.shard.stages import plan_for

PARAMS = [("emb", (8, 4), True), ("norm", (4,), True), ("base", (4, 4), False), ("bias", (2,), False)]
GROUPS = {"emb": 1, "norm": 0}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_gather_trainable_and_replicate_frozen(stage):
    placed = place(PARAMS, plan_for(stage), 0, GROUPS)
    assert [pl.residence for pl in placed] == [Residence.GATHERED] * 2 + [Residence.REPLICATED] * 2
    assert [pl.bucket_plan(plan_for(stage)) for pl in placed[:2]] == [plan_for(stage)] * 2
    assert [pl.group for pl in placed] == [1, 0, 0, 0]


def test_stage_3_shards_from_the_persistence_threshold():
    placed = {pl.fqn: pl for pl in place(PARAMS, plan_for(3), 5, GROUPS)}
    assert placed["emb"].residence is Residence.SHARDED and placed["emb"].bucket_plan(plan_for(3)) == plan_for(3)
    assert placed["norm"].residence is Residence.GATHERED and placed["norm"].bucket_plan(plan_for(3)) == plan_for(2)
    assert placed["base"].residence is Residence.SHARDED and placed["base"].bucket_plan(plan_for(3)) is plan_for(3)
    assert placed["bias"].residence is Residence.REPLICATED and not placed["bias"].bucketed
    assert placed["emb"].numel == 32 and placed["emb"].spec == ("emb", (8, 4), 1)


def test_a_placement_is_frozen():
    pl = ParamPlacement("w", (2,), True, Residence.GATHERED)
    with pytest.raises(AttributeError):
        pl.trainable = False


def test_a_buckets_parameters_share_one_kind_all_but_name_and_shape():
    """ShardedModel builds a bucket from the kind its parameters share (and checks that they do): the name and
    shape are a parameter's own, everything else (trains, residence, group, tier, codecs) the bucket's."""
    placed = {pl.fqn: pl for pl in place(PARAMS, plan_for(3), 5, GROUPS)}
    assert placed["base"].bucket_kind() == place([("other", (7, 3), False)], plan_for(3), 5, {})[0].bucket_kind()
    other_group = place([("other", (8, 4), True)], plan_for(3), 5, {"other": 0})[0]
    assert placed["emb"].bucket_kind() != other_group.bucket_kind()
    assert placed["emb"].bucket_kind() != placed["base"].bucket_kind()  # trains, and does not
    assert not hasattr(placed["emb"], "unit") and not hasattr(placed["emb"], "owner")  # the planner's, kept apart
