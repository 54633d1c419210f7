"""``param.ds_status`` on the parameters of a stage-3 engine: whether the full tensor is in place now, as
DeepSpeed 0.19.8 keeps it on each ZeRO-3 parameter (``ZeroParamStatus``).

Frameworks read it to decide whether to gather a parameter they use outside its module's forward: TRL's
fused LM head multiplies by ``lm_head.weight`` directly and wraps that in ``GatheredParameters`` only where
``p.ds_status != ZeroParamStatus.AVAILABLE`` (gathering a parameter that is already gathered, such as one
tied to an embedding in use, would release it underneath its owner on leaving).

zerompi keeps no per-parameter state to store: a parameter is a view into its bucket's full buffer, whose
state the gather units change as forward and backward run. So the status is read, not stored: stage 3's
parameters become a subclass of ``nn.Parameter`` (:class:`StatusParameter`, the same object, ``isinstance``
unchanged) whose ``ds_status`` property asks the bucket. Only plain ``nn.Parameter``s are re-classed; another
subclass (a quantised weight) keeps its class and has no ``ds_status``, as before. ``ds_id`` stays absent:
scripts that select ``hasattr(p, "ds_id")`` parameters to gather still select none (see partition_parameters).
"""
from __future__ import annotations

import weakref

from torch import nn

from zerompi.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from zerompi.shard.collectives import BucketState

__all__ = ["StatusParameter", "mark"]

_BUCKET = "_zerompi_status_bucket"  # a weak reference to the collectives of the bucket whose buffer it views

_BY_STATE = {BucketState.SHARDED: ZeroParamStatus.NOT_AVAILABLE, BucketState.GATHERING: ZeroParamStatus.INFLIGHT,
             BucketState.GATHERED: ZeroParamStatus.AVAILABLE}


class StatusParameter(nn.Parameter):
    """An ``nn.Parameter`` of a stage-3 engine; ``ds_status`` says whether its full values are in place."""

    @property
    def ds_status(self) -> ZeroParamStatus:
        ref = self.__dict__.get(_BUCKET)
        collectives = ref() if ref is not None else None
        if collectives is None:  # the engine is gone (closed and dropped): the storage itself says
            return ZeroParamStatus.AVAILABLE if _in_storage(self.data) else ZeroParamStatus.NOT_AVAILABLE
        if not collectives.plan.shard_params:  # replicated (a persistent bucket)
            return ZeroParamStatus.AVAILABLE
        if not collectives.bucket.holds(self.data):
            return ZeroParamStatus.AVAILABLE  # a whole copy in place: GatheredParameters' block
        return _BY_STATE[collectives.state]


def _in_storage(t) -> bool:
    """Whether ``t``'s elements lie in its storage: a sharded parameter left bound to a dropped engine's buffer
    views freed storage (reading it would crash), a parameter given new data does not."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def mark(engine) -> None:
    """Give every parameter of ``engine``'s module (a zerompi Engine at stage 3) its ``ds_status``."""
    if int(engine.config.stage) != 3:
        return  # DeepSpeed's ZeRO-1/2 parameters have no ds_status either
    owner = {id(p): c for c in engine.sharded.all_collectives for p in c.bucket.params}
    for p in engine.module.parameters():
        if type(p) is not nn.Parameter:
            continue
        p.__class__ = StatusParameter  # the same object: buckets, optimizer groups and ties keep it
        bucket = owner.get(id(p))
        if bucket is not None:
            setattr(p, _BUCKET, weakref.ref(bucket))
