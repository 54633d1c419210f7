"""The pieces ZeroMPIStrategy hands Lightning, on a world of one (MPI.COMM_SELF): the optimizer Lightning holds
shares the engine's param groups and state and refuses what it cannot do by name; the module Lightning unwraps
is the engine's; the strategy's defaults. Lightning's Trainer over them: test_lightning_fit.py (one rank) and
tests/mpi/test_lightning.py."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.components import require_module

L = require_module("lightning")

from mpi4py import MPI  # noqa: E402

import zerompi  # noqa: E402
from zerompi.compat.lightning import ZeroMPIStrategy  # noqa: E402
from zerompi.compat.lightning.strategy import EngineModule, WindowOptimizer  # noqa: E402
from zerompi.config import ZeroConfig  # noqa: E402
from zerompi.errors import UsageError  # noqa: E402


@pytest.fixture
def engine():
    torch.manual_seed(0)
    e = zerompi.initialize(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)),
                           ZeroConfig(stage=2, lr=0.1, cpu_threads=1, abort_on_exception=False), comm=MPI.COMM_SELF)
    yield e
    e.close()


def test_the_window_optimizer_is_the_engines_groups_and_state(engine):
    """A scheduler or the learning-rate monitor sets and reads the engine's own group dicts."""
    opt = WindowOptimizer(engine)
    assert opt.param_groups[0] is engine.optimizer.param_groups[0] and opt.state is engine.optimizer.state
    opt.param_groups[0]["lr"] = 0.05
    assert engine.optimizer.param_groups[0]["lr"] == 0.05


def test_the_window_optimizer_refuses_a_step_and_its_state_dict_by_name(engine):
    opt = WindowOptimizer(engine)
    opt.zero_grad()  # nothing to clear: each step consumes its window's reduced gradients
    with pytest.raises(UsageError, match="the engine steps in ZeroMPIStrategy.optimizer_step"):
        opt.step()
    with pytest.raises(UsageError, match="saved by trainer.save_checkpoint"):
        opt.state_dict()
    with pytest.raises(UsageError, match=r"restored from trainer.fit\(ckpt_path=...\)"):
        opt.load_state_dict({})


def test_a_scheduler_over_it_does_not_warn_of_a_step_never_taken(engine):
    """torch warns when a scheduler steps before its optimizer, or over a step it did not wrap; the engine steps
    (the strategy then marks ``_opt_called``, as torch's wrapper would), and its step says it needs no wrapper."""
    opt = WindowOptimizer(engine)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    opt._opt_called = True  # ZeroMPIStrategy.optimizer_step, after the engine's step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()


def test_the_module_lightning_unwraps_is_the_engines(engine):
    wrapped = EngineModule(engine)
    assert wrapped.module is engine.module and wrapped.engine is engine
    x = torch.randn(2, 4)
    assert torch.equal(wrapped(x), engine(x))


def test_the_strategy_takes_its_config_or_the_default():
    cfg = ZeroConfig(stage=1, cpu_threads=1)
    strategies = [ZeroMPIStrategy(cfg, comm=MPI.COMM_SELF), ZeroMPIStrategy(comm=MPI.COMM_SELF)]
    try:
        assert strategies[0].config is cfg and strategies[1].config == ZeroConfig()
        assert strategies[0].is_distributed is True and strategies[0].root_device == torch.device("cpu")
        assert strategies[0].distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    finally:
        for s in strategies:
            s.close()


@pytest.mark.parametrize("name, stage",
                         [("zerompi", ZeroConfig().stage)] + [(f"zerompi_stage_{s}", s) for s in range(4)])
def test_lightning_knows_the_strategy_by_name(name, stage):
    """Trainer(strategy="zerompi_stage_3") as a Lightning user writes strategy="deepspeed_stage_3"."""
    from lightning.pytorch.strategies import StrategyRegistry
    strategy = StrategyRegistry.get(name)
    try:
        assert isinstance(strategy, ZeroMPIStrategy) and strategy.config.stage == stage
    finally:
        strategy.close()
