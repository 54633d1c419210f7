"""ResilientEngine presents the Engine's interface explicitly (zerompi/recovery/engine.py's _present_engine):
every public method, property and declared attribute of Engine is a member of the class, methods with
Engine's signatures and docstrings, and nothing is reached through ``__getattr__``. Whether the guarded verbs
recover: tests/mpi/test_ulfm.py (ULFM's lane)."""
from __future__ import annotations

import inspect

import torch

from tests.unit.engines import small_stage3_engine
from zerompi.engine import Engine
from zerompi.recovery import ResilientEngine


def test_engine_declares_the_public_attributes_it_sets():
    """Break guarded: an attribute added to Engine.__init__ and not to ATTRIBUTES (a resilient engine would
    then not have it)."""
    engine = small_stage3_engine()
    try:
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        assert {k for k in vars(engine) if not k.startswith("_")} == set(Engine.ATTRIBUTES)
    finally:
        engine.close()


def test_every_public_member_of_engine_is_a_member_of_the_resilient_engine():
    """Breaks guarded: a verb left out (it would run unguarded, or not at all); a __getattr__ that hides what
    the class offers."""
    assert "__getattr__" not in vars(ResilientEngine)
    public = {n for n in vars(Engine) if not n.startswith("_")} - {"ATTRIBUTES"}
    members = vars(ResilientEngine)
    assert public <= set(members) and set(Engine.ATTRIBUTES) - set(ResilientEngine.OWN) <= set(members)
    for name in public:
        ours, theirs = inspect.getattr_static(ResilientEngine, name), inspect.getattr_static(Engine, name)
        assert isinstance(ours, property) == isinstance(theirs, property), name
        if not isinstance(theirs, property):
            assert inspect.signature(getattr(ResilientEngine, name)) == inspect.signature(getattr(Engine, name)), name
            assert getattr(ResilientEngine, name).__doc__ == theirs.__doc__, name


class _Supervised:
    """The attributes a ResilientEngine's generated members read, around an Engine of the moment."""

    def __init__(self, current):
        self.current, self.calls = current, []

    def _guarded(self, name, *args, **kwargs):
        self.calls.append(name)
        return getattr(self.current, name)(*args, **kwargs)


def test_the_generated_members_guard_verbs_and_read_the_current_engines_attributes():
    """On a stand-in supervisor (a ResilientEngine needs ULFM): a verb goes through _guarded, a property and an
    attribute read the current engine."""
    engine = small_stage3_engine()
    try:
        sup = _Supervised(engine)
        assert ResilientEngine.full_state_dict(sup).keys() == engine.full_state_dict().keys()
        assert sup.calls == ["full_state_dict"]
        assert ResilientEngine.world_size.fget(sup) == 1 and ResilientEngine.config.fget(sup) is engine.config
        assert ResilientEngine.module.fget(sup) is engine.module
    finally:
        engine.close()
