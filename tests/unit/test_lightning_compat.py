"""ZeroMPIStrategy's translations (zerompi/compat/lightning/translate.py) and collectives (collectives.py),
without MPI: what Lightning asks is taken over exactly or refused by name; reductions give every rank the
same values (ranks as threads of zerompi.comm.local). The strategy itself trains in tests/mpi/test_lightning.py;
here, on a world of one (MPI.COMM_SELF), it refuses an accumulation window Lightning and the engine disagree on."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.components import require_module

L = require_module("lightning")

from mpi4py import MPI  # noqa: E402

from zerompi.comm.local import run_ranks  # noqa: E402
from zerompi.compat.lightning import ZeroMPIStrategy, collectives, translate  # noqa: E402
from zerompi.config import ZeroConfig  # noqa: E402
from zerompi.errors import UsageError  # noqa: E402


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def config_for(cfg, opt, m, **kw):
    args = dict(accumulate=1, automatic=True, clip_val=None, clip_algorithm=None, accelerator="cpu")
    return translate.engine_config(cfg, opt, m, **{**args, **kw})


def test_the_optimizer_and_its_groups_become_the_config():
    m = model()
    opt = torch.optim.AdamW([{"params": [m[0].weight, m[1].weight]},
                             {"params": [m[0].bias, m[1].bias], "weight_decay": 0.0}], lr=3e-3, betas=(0.8, 0.9))
    cfg, groups = config_for(ZeroConfig(stage=3), opt, m, accumulate=4, clip_val=0.5)
    assert cfg.optimizer is torch.optim.AdamW and cfg.lr == 3e-3 and cfg.optimizer_kwargs["betas"] == (0.8, 0.9)
    assert "lr" not in cfg.optimizer_kwargs and cfg.grad_accum_steps == 4 and cfg.clip_grad_norm == 0.5
    assert cfg.stage == 3 and cfg.device == "cpu"
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and groups[1]["params"] == [m[0].bias, m[1].bias]


def test_frozen_parameters_leave_the_groups():
    m = model()
    m[0].requires_grad_(False)
    _, groups = config_for(ZeroConfig(), torch.optim.SGD(m.parameters(), lr=0.1), m)
    assert groups[0]["params"] == [m[1].weight, m[1].bias]


@pytest.mark.parametrize("cfg,kw,named", [
    (ZeroConfig(lr=1e-4), {}, "the config sets lr"),
    (ZeroConfig(grad_accum_steps=3), {"accumulate": 2}, "accumulate_grad_batches=2"),
    (ZeroConfig(clip_grad_norm=2.0), {"clip_val": 1.0}, "gradient_clip_val=1.0"),
    (ZeroConfig(), {"clip_val": 1.0, "clip_algorithm": "value"}, "gradient_clip_algorithm='value'"),
    (ZeroConfig(device="cuda"), {}, "device='cuda'"),
    (ZeroConfig(micro_batches=4), {}, "micro_batches=4"),
])
def test_what_disagrees_is_refused_by_name(cfg, kw, named):
    m = model()
    with pytest.raises(UsageError, match=named.replace("(", r"\(").replace(")", r"\)")):
        config_for(cfg, torch.optim.Adam(m.parameters(), lr=1e-3), m, **kw)


def test_a_parameter_of_another_module_is_refused():
    m = model()
    with pytest.raises(UsageError, match="not the LightningModule's own"):
        config_for(ZeroConfig(), torch.optim.SGD([*m.parameters(), nn.Parameter(torch.ones(2))], lr=0.1), m)


def test_a_scheduler_beside_the_configs_schedule_is_refused():
    cfg = ZeroConfig(lr_schedule="warmup_cosine", warmup_steps=1, total_steps=10)
    with pytest.raises(UsageError, match="both would set the learning rate"):
        translate.check_scheduler(cfg, [object()])
    translate.check_scheduler(ZeroConfig(), [object()])


def test_manual_optimization_keeps_the_configs_window():
    m = model()
    cfg, _ = config_for(ZeroConfig(grad_accum_steps=3), torch.optim.SGD(m.parameters(), lr=0.1), m, automatic=False)
    assert cfg.grad_accum_steps == 3


@pytest.mark.parametrize("op,expect", [("mean", [1.5, 3.0]), ("sum", [6.0, 12.0]), ("max", [3.0, 6.0]),
                                       ("min", [0.0, 0.0])])
def test_reduce_gives_every_rank_the_same_result(op, expect):
    def body(group):
        t = torch.tensor([float(group.rank), 2.0 * group.rank])
        return collectives.reduce(t, group, op).tolist(), collectives.gather_rows(t > 0, group).tolist(), \
            collectives.broadcast(f"from {group.rank}", 2, group)
    results = run_ranks(4, body)
    assert all(r == (expect, [[False, False], [True, True], [True, True], [True, True]], "from 2") for r in results)


def test_reduce_refuses_an_unknown_op_and_a_subgroup():
    with pytest.raises(UsageError, match="allowed sum, mean"):
        collectives.op_name("product")
    with pytest.raises(UsageError, match="only the whole job's group"):
        collectives.no_subgroup(object(), "reduce")
    assert collectives.op_name(torch.distributed.ReduceOp.SUM) == "sum"


class _Linear(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_epoch_that_ends_inside_a_window_is_refused(tmp_path):
    """5 batches an epoch, accumulate_grad_batches=2. With the strategy handling accumulation, Lightning does not
    end the window at the epoch's end: its fifth batch waits in the engine, whose window then ends at epoch 1's
    first batch, where Lightning's (counted within the epoch) does not. The strategy stops there, after epoch 0's
    two whole windows. Guards: the refusal in ZeroMPIStrategy.optimizer_step removed."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(10, 4, generator=g), torch.randn(10, 2, generator=g))
    strategy = ZeroMPIStrategy(ZeroConfig(stage=2, device="cpu", cpu_threads=1, abort_on_exception=False),
                               comm=MPI.COMM_SELF)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=2, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    try:
        with pytest.raises(UsageError, match="batch 0 of epoch 1: the engine's accumulation window and "
                                             "Lightning's disagree about where a step falls"):
            trainer.fit(_Linear(), torch.utils.data.DataLoader(data, batch_size=2))
        assert trainer.global_step == 2
    finally:
        strategy.close()
