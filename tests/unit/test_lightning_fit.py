"""Lightning's Trainer with ZeroMPIStrategy on a world of one (MPI.COMM_SELF), in this process: a fit is the
plain torch loop's arithmetic, a checkpoint resumes into the uninterrupted run's bits, and the strategy's
collectives, state dict and refusals work as Lightning calls them. Two ranks: tests/mpi/test_lightning.py."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from tests.components import require_module

L = require_module("lightning")

from mpi4py import MPI  # noqa: E402

from zerompi.compat.lightning import ZeroMPIStrategy  # noqa: E402
from zerompi.config import ZeroConfig  # noqa: E402
from zerompi.errors import UsageError  # noqa: E402


def _data(n: int = 8) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


class _Net(L.LightningModule):
    def __init__(self, none_at: int | None = None, optimizers: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.none_at, self.count = nn.Linear(4, 2), none_at, optimizers
        self.automatic_optimization = optimizers == 1  # Lightning refuses two under automatic optimization
        self.register_buffer("seen", torch.zeros(()))

    def training_step(self, batch, batch_idx):
        if batch_idx == self.none_at:
            return None
        x, y = batch
        self.seen += 1
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizers = [torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9) for _ in range(self.count)]
        return optimizers[0] if self.count == 1 else optimizers


class _Manual(_Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x), y), retain_graph=True)


def _trainer(tmp_path, epochs: int = 1, accumulate: int = 2, config: ZeroConfig | None = None,
             **trainer_kw) -> tuple[L.Trainer, ZeroMPIStrategy]:
    strategy = ZeroMPIStrategy(config or ZeroConfig(stage=2, cpu_threads=1, abort_on_exception=False),
                               comm=MPI.COMM_SELF)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, accumulate_grad_batches=accumulate,
                        use_distributed_sampler=False,  # the loader's order, as the plain loop reads it
                        **trainer_kw)
    return trainer, strategy


def _loader():
    return torch.utils.data.DataLoader(_data(), batch_size=2)


def _plain(epochs: int) -> dict[str, torch.Tensor]:
    """The plain loop: each window's two mean losses halved (accumulate_grad_batches=2), then SGD's step."""
    module = _Net()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for _ in range(epochs):
        for i, (x, y) in enumerate(_loader()):
            (nn.functional.mse_loss(module.net(x), y) / 2).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _fit(tmp_path, epochs: int = 1, module=None, config: ZeroConfig | None = None, trainer_kw: dict | None = None,
         **kw) -> tuple[L.Trainer, ZeroMPIStrategy, L.LightningModule]:
    """``module`` (a _Net) fitted; ``kw`` goes to fit, ``trainer_kw`` to the Trainer. The strategy is closed if
    the fit raises, else it is the caller's."""
    module = module or _Net()
    trainer, strategy = _trainer(tmp_path, epochs, 2 if module.automatic_optimization else 1, config,
                                 **(trainer_kw or {}))
    try:
        trainer.fit(module, _loader(), **kw)
    except BaseException:
        strategy.close()
        raise
    return trainer, strategy, module


def test_a_fit_is_the_plain_loops_arithmetic(tmp_path):
    """Lightning divides each loss by accumulate_grad_batches; the engine adds nothing more (fp32: no loss
    scale), reduces over one rank and steps SGD with momentum on its flat shard: the plain loop's values."""
    trainer, strategy, _ = _fit(tmp_path, epochs=2)
    try:
        got = strategy.lightning_module_state_dict()
        want = _plain(2)
        assert trainer.global_step == 4 and set(got) == {"net.weight", "net.bias", "seen"}
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7)
        assert got["seen"] == 8  # buffers as this rank holds them
    finally:
        strategy.close()


def test_a_checkpoint_resumes_into_the_uninterrupted_runs_bits(tmp_path):
    """trainer.save_checkpoint writes a directory (the engine's HDF5 and Lightning's state); fit(ckpt_path)
    continues it to the bits of two epochs in one run. A path that is not such a directory is refused."""
    trainer, strategy, _ = _fit(tmp_path / "a")
    path = tmp_path / "one-epoch"
    try:
        trainer.save_checkpoint(path)
    finally:
        strategy.close()
    assert (path / "lightning.ckpt").is_file() and (path / "checkpoint" / "index.h5").is_file()
    resumed, strategy, _ = _fit(tmp_path / "b", epochs=2, ckpt_path=str(path))
    try:
        got = strategy.lightning_module_state_dict()
        assert resumed.global_step == 4
    finally:
        strategy.close()
    whole, strategy, _ = _fit(tmp_path / "c", epochs=2)
    try:
        want = strategy.lightning_module_state_dict()
    finally:
        strategy.close()
    assert all(torch.equal(got[n], want[n]) for n in ("net.weight", "net.bias")), (got, want)
    with pytest.raises(UsageError, match="not a ZeroMPIStrategy checkpoint"):
        _fit(tmp_path / "d", ckpt_path=str(tmp_path / "a"))


def test_the_strategys_collectives_on_one_rank(tmp_path):
    trainer, strategy, _ = _fit(tmp_path)
    try:
        t = torch.tensor([1.0, 3.0])
        assert torch.equal(strategy.reduce(t), t) and strategy.reduce(2.5) == 2.5
        assert torch.equal(strategy.reduce(t, reduce_op="sum"), t)
        assert torch.equal(strategy.all_gather(t), t.unsqueeze(0))
        with pytest.raises(UsageError, match=r"all_gather\(sync_grads=True\)"):
            strategy.all_gather(t, sync_grads=True)
        assert strategy.broadcast({"a": 1}) == {"a": 1}
        strategy.barrier()
        assert strategy.optimizer_state(None) == {} and strategy.lightning_restore_optimizer is False
        assert strategy.restore_checkpoint_after_setup is True
        with pytest.raises(UsageError, match="save_checkpoint"):
            strategy.save_checkpoint({}, tmp_path / "x", storage_options={"a": 1})
    finally:
        strategy.close()


@pytest.mark.parametrize("module,named", [
    (lambda: _Net(none_at=1), "training_step returned None"),
    (_Manual, "backward arguments"),
])
def test_what_breaks_the_window_is_refused_by_name(tmp_path, module, named):
    with pytest.raises(UsageError, match=f"ZeroMPIStrategy: {named}"):
        _fit(tmp_path, module=module())


class _Hooks(L.Callback):
    """Counts the hooks Lightning's own backward and step would call, which the strategy must call too."""

    def __init__(self):
        self.calls = {"on_before_backward": 0, "on_after_backward": 0, "on_before_optimizer_step": 0}

    def on_before_backward(self, trainer, module, loss):
        self.calls["on_before_backward"] += 1

    def on_after_backward(self, trainer, module):
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls["on_before_optimizer_step"] += 1


class _Scheduled(_Net):
    before_step = 0

    def on_before_optimizer_step(self, optimizer):
        self.before_step += 1

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "interval": "step"}]


@pytest.mark.parametrize("accumulate", [2, 1])
def test_the_callbacks_hooks_run_and_a_scheduler_sees_its_steps(tmp_path, accumulate):
    """4 batches, windows of ``accumulate``: every backward's two hooks, the step's hook; a per-step scheduler
    gives no warning of a step it did not see (the strategy marks each step for torch's schedulers), and it
    sets the engine's learning rate (StepLR built on the module's SGD: 0.1 * 0.5**steps).
    Break guarded (windows of 1): the step marked when the engine did not update, in place of when it did."""
    hooks, steps = _Hooks(), 4 // accumulate
    trainer, strategy = _trainer(tmp_path, accumulate=accumulate, callbacks=[hooks])
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*lr_scheduler.step().*")
            trainer.fit(module := _Scheduled(), _loader())
        # Lightning calls optimizer_step on every batch when the strategy handles accumulation; the hook runs
        # before the steps that update, as under Lightning's own accumulation
        assert hooks.calls == {"on_before_backward": 4, "on_after_backward": 4, "on_before_optimizer_step": steps}
        assert module.before_step == steps  # the LightningModule's own hook too
        assert strategy.engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** steps)
    finally:
        strategy.close()


class _Raises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a backward that fails")


class _FailingBackward(_Net):
    def training_step(self, batch, batch_idx):
        return _Raises.apply(super().training_step(batch, batch_idx))


def test_a_failing_backward_raises_and_leaves_the_engine_where_it_was(tmp_path):
    """The first backward of a window raises: the error reaches the caller and the engine's iteration is back
    in IDLE (its gradients not reduced), not waiting for the rest of a window."""
    trainer, strategy = _trainer(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="a backward that fails"):
            trainer.fit(_FailingBackward(), _loader())
        assert strategy.engine.iteration.idle
    finally:
        strategy.close()


def test_arguments_the_engine_does_not_take_are_refused(tmp_path):
    trainer, strategy, _ = _fit(tmp_path)
    try:
        with pytest.raises(UsageError, match=r"optimizer_step arguments \['foo'\]"):
            strategy.optimizer_step(None, lambda: None, foo=1)
        for call in (lambda: strategy.reduce(torch.ones(1), group=object()),
                     lambda: strategy.all_gather(torch.ones(1), group=object())):
            with pytest.raises(UsageError):
                call()
    finally:
        strategy.close()


def test_close_ends_the_engine(tmp_path):
    """The engine's gradient hooks leave the parameters, the strategy lets go of it, and the strategy's own
    communicator is released (MPI_Comm_free): a collective after close() is refused by MPI.
    Break guarded: close() leaving the communicator to MPI_Finalize (a handle leaked per Trainer)."""
    trainer, strategy, module = _fit(tmp_path)
    assert all(p._post_accumulate_grad_hooks for p in module.parameters())  # stage 2's reduction hooks
    strategy.close()
    assert strategy.engine is None and not any(p._post_accumulate_grad_hooks for p in module.parameters())
    with pytest.raises(MPI.Exception, match="[Nn]ull communicator|[Ii]nvalid communicator"):
        strategy.barrier()


class _OwnBackward(_Net):
    def backward(self, loss, *args, **kwargs):
        loss.backward()


class _OwnClipping(_Net):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        pass


@pytest.mark.parametrize("module,trainer_kw,named", [
    (_OwnBackward, {}, "_OwnBackward.backward is overridden"),
    (_OwnClipping, {}, "_OwnClipping.configure_gradient_clipping is overridden"),
    (lambda: _Net(optimizers=2), {}, "configure_optimizers returns 2 optimizers"),
    (_Net, {"precision": "bf16-mixed"}, "Trainer(precision='bf16-mixed')"),
])
def test_what_the_engine_does_itself_is_refused_by_name(module, trainer_kw, named, tmp_path):
    with pytest.raises(UsageError, match=re.escape(f"ZeroMPIStrategy: {named}")):
        _fit(tmp_path, module=module(), trainer_kw=trainer_kw)


def test_a_scheduler_beside_the_configs_schedule_is_refused(tmp_path):
    cfg = ZeroConfig(stage=2, cpu_threads=1, abort_on_exception=False, lr_schedule="warmup_cosine", total_steps=10)
    with pytest.raises(UsageError, match="configure_optimizers returns an lr scheduler and ZeroConfig"):
        _fit(tmp_path, module=_Scheduled(), config=cfg)


class _Tied(_Net):
    """Two Linears sharing one weight: the state dict names it twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        self.net[1].weight = self.net[0].weight


def test_a_tied_weights_second_name_saves_the_whole_tensor_at_stage_3(tmp_path):
    """At stage 3 a rank holds no whole parameter between steps; the strategy's state dict takes each from the
    engine's full state dict, under every name it has (a tied weight's second included). Compared with the
    module's own parameter gathered by the engine. Guards: aliases found with named_parameters()'s
    deduplication, which gives the second name the rank's stand-in instead."""
    config = ZeroConfig(stage=3, cpu_threads=1, abort_on_exception=False, param_persistence_threshold=0)
    _, strategy, _ = _fit(tmp_path, module=_Tied(), config=config)
    try:
        state = strategy.lightning_module_state_dict()
        full = strategy.engine.full_state_dict()
        assert torch.equal(state["net.1.weight"], full["net.0.weight"])
        assert torch.equal(state["net.0.weight"], full["net.0.weight"])
    finally:
        strategy.close()


class _StepsByHand(_Net):
    """Manual optimization as Lightning documents it: the closure runs the backward, ``opt.step`` returns what
    the closure returned."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.returned: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)

        def closure():
            self.manual_backward(loss)
            return loss
        self.returned.append((self.optimizers().step(closure=closure), loss))


def test_a_manual_step_returns_what_its_closure_returned(tmp_path):
    """Guards: ZeroMPIStrategy.optimizer_step dropping the closure's result (Lightning hands it back from
    LightningOptimizer.step)."""
    _, strategy, module = _fit(tmp_path, module=_StepsByHand())
    strategy.close()
    assert len(module.returned) == 4 and all(out is loss for out, loss in module.returned), module.returned


def test_a_bf16_config_gets_its_inputs_cast_by_the_engine(tmp_path):
    """ZeroConfig(dtype='bf16') with Lightning at '32-true' and fp32 batches: the forward goes through the
    engine (the strategy's model), which casts floating inputs to the compute dtype. Guards: the strategy
    handing Lightning the bare module (fp32 inputs then meet bf16 weights)."""
    config = ZeroConfig(stage=2, dtype="bf16", cpu_threads=1, abort_on_exception=False)
    before = {n: p.detach().clone() for n, p in _Net().named_parameters()}
    _, strategy, module = _fit(tmp_path, config=config)
    try:
        after = strategy.lightning_module_state_dict()
        assert all(not torch.equal(after[n].float(), before[n]) for n in before), "nothing trained"
    finally:
        strategy.close()


class _OtherAccelerator(L.pytorch.accelerators.Accelerator):
    """Neither Lightning's CPU nor its CUDA accelerator (an XLA or MPS device, as a user would pass one)."""

    def setup_device(self, device):
        pass

    def teardown(self):
        pass

    @staticmethod
    def parse_devices(devices):
        return devices

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("cpu")]

    @staticmethod
    def auto_device_count():
        return 1

    @staticmethod
    def is_available():
        return True

    def get_device_stats(self, device):
        return {}

    @classmethod
    def name(cls):
        return "other"


class _Elsewhere(ZeroMPIStrategy):
    """Lightning's root device not the one the engine picks (on a GPU node: the engine on cuda:0, Lightning on
    cuda:1); on the CPU, an explicit index stands for it."""

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", 0)


def test_an_accelerator_or_device_the_engine_does_not_run_on_is_refused(tmp_path):
    """Breaks guarded: the accelerator check removed (the engine would run on the CPU while Lightning moves
    batches elsewhere), and the engine's device left unchecked against Lightning's root device."""
    cfg = ZeroConfig(stage=2, cpu_threads=1, abort_on_exception=False)
    for strategy, accelerator, named in ((ZeroMPIStrategy(cfg, comm=MPI.COMM_SELF), _OtherAccelerator(),
                                          "the _OtherAccelerator: zerompi runs on CPUs and CUDA GPUs"),
                                         (_Elsewhere(cfg, comm=MPI.COMM_SELF), "cpu",
                                          "the engine's device cpu: Lightning's is cpu:0")):
        trainer = L.Trainer(strategy=strategy, accelerator=accelerator, devices=1, max_epochs=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
        try:
            with pytest.raises(UsageError, match=re.escape(f"ZeroMPIStrategy: {named}")):
                trainer.fit(_Net(), _loader())
        finally:
            strategy.close()
