"""The pieces ZeroMPIStrategy hands Lightning, on a world of one (MPI.COMM_SELF): the optimizer Lightning holds
shares the engine's param groups and state and refuses what it cannot do by name; the module Lightning unwraps
is the engine's; the strategy's defaults. Lightning's Trainer over them runs in tests/mpi/test_lightning.py."""
from __future__ import annotations

import re
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


class _Net(L.LightningModule):
    def __init__(self, optimizers: int = 1, gamma: float | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.count, self.gamma = nn.Linear(4, 2), optimizers, gamma
        self.automatic_optimization = optimizers == 1  # Lightning refuses two under automatic optimization

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizers = [torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(self.count)]
        if self.gamma is None:
            return optimizers[0] if self.count == 1 else optimizers
        scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=self.gamma)
        return [optimizers[0]], [{"scheduler": scheduler, "interval": "step"}]


class _OwnBackward(_Net):
    def backward(self, loss, *args, **kwargs):
        loss.backward()


class _OwnClipping(_Net):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        pass


def _fit(module, steps: int = 2, config: ZeroConfig | None = None, **trainer_kw):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(2 * steps, 4, generator=g), torch.randn(2 * steps, 2, generator=g))
    strategy = ZeroMPIStrategy(config or ZeroConfig(stage=2, cpu_threads=1, abort_on_exception=False),
                               comm=MPI.COMM_SELF)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        **trainer_kw)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
        return strategy.engine.optimizer.param_groups[0]["lr"]
    finally:
        strategy.close()


@pytest.mark.parametrize("module,kw,named", [
    (_OwnBackward, {}, "_OwnBackward.backward is overridden"),
    (_OwnClipping, {}, "_OwnClipping.configure_gradient_clipping is overridden"),
    (lambda: _Net(optimizers=2), {}, "configure_optimizers returns 2 optimizers"),
    (_Net, {"precision": "bf16-mixed"}, "Trainer(precision='bf16-mixed')"),
])
def test_what_the_engine_does_itself_is_refused_by_name(module, kw, named, tmp_path):
    with pytest.raises(UsageError, match=re.escape(f"ZeroMPIStrategy: {named}")):
        _fit(module(), default_root_dir=tmp_path, **kw)


def test_a_scheduler_beside_the_configs_schedule_is_refused(tmp_path):
    cfg = ZeroConfig(stage=2, cpu_threads=1, abort_on_exception=False, lr_schedule="warmup_cosine", total_steps=10)
    with pytest.raises(UsageError, match="configure_optimizers returns an lr scheduler and ZeroConfig"):
        _fit(_Net(gamma=0.5), config=cfg, default_root_dir=tmp_path)


def test_the_modules_scheduler_sets_the_engines_learning_rate(tmp_path):
    """StepLR(gamma=0.5) built on the module's SGD: after 3 steps the engine's group has 0.1 * 0.5**3."""
    assert _fit(_Net(gamma=0.5), steps=3, default_root_dir=tmp_path) == pytest.approx(0.1 * 0.5 ** 3)
