"""The package surface DeepSpeed scripts import, on a world of one: accelerator, comm, utils,
checkpointing, the version, and the two names of every module."""
from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zerompi
import zerompi.deepspeed as deepspeed
from tests.components import RAN, ran, unavailable
from zerompi.errors import UsageError


def test_submodules_are_one_object_under_both_names():
    import zerompi.compat.deepspeed as package
    import zerompi.deepspeed.comm as dist
    from zerompi.compat.deepspeed.ops import adam
    from zerompi.deepspeed.accelerator import get_accelerator
    from zerompi.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    assert deepspeed is package and dist is package.comm
    assert FusedAdam is adam.FusedAdam and DeepSpeedCPUAdam is adam.DeepSpeedCPUAdam
    assert get_accelerator is package.accelerator.get_accelerator
    for name in ("initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "scheduler_factory",
                 "zero", "checkpointing", "utils", "ops"):
        assert hasattr(deepspeed, name), name


def test_version_reads_as_deepspeed_and_says_zerompi():
    from packaging.version import Version
    v = Version(deepspeed.__version__)
    assert v.release == (0, 19, 8) and v.local.startswith("zerompi")


def test_cpu_accelerator_answers():
    acc = deepspeed.accelerator.get_accelerator()
    assert acc is deepspeed.accelerator.get_accelerator()
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the CUDA accelerator answers")
    assert (acc.device_name(), acc.device_name(0), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.is_available() and acc.device_count() >= 1 and acc.current_device() == int(
        os.environ.get("LOCAL_RANK", 0))
    assert acc.communication_backend_name() == "gloo" and acc.is_bf16_supported()
    assert isinstance(acc.is_fp16_supported(), bool)
    assert 0 < acc.memory_allocated() <= acc.max_memory_allocated() < acc.total_memory()
    acc.synchronize()
    acc.empty_cache()
    acc.set_device(0)
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed_all(3)
    assert torch.equal(a, torch.rand(2))
    assert acc.device() == torch.device("cpu") and acc.on_accelerator(torch.zeros(1))


def test_cuda_accelerator_by_environment(monkeypatch):
    from zerompi.compat.deepspeed import accelerator
    monkeypatch.setattr(accelerator, "_chosen", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    acc = accelerator.get_accelerator()
    assert acc.device_name(1) == "cuda:1" and acc.communication_backend_name() == "nccl"
    assert acc.is_available() == torch.cuda.is_available()
    monkeypatch.setattr(accelerator, "_chosen", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(UsageError, match="DS_ACCELERATOR='xpu'"):
        accelerator.get_accelerator()
    monkeypatch.setattr(accelerator, "_chosen", None)


def test_comm_on_one_rank():
    dist = deepspeed.comm
    assert dist.get_rank() == 0 and dist.get_world_size() == 1
    deepspeed.init_distributed(dist_backend="nccl")  # the backend has nothing to choose
    deepspeed.init_distributed()  # once only
    assert dist.is_initialized() and dist.get_local_rank() == 0
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_SIZE"]) == \
        ("0", "0", "1", "1")
    t = torch.tensor([[1.5, -2.0]])
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, torch.distributed.ReduceOp.MIN):
        dist.all_reduce(t, op=op)
        assert t.tolist() == [[1.5, -2.0]]
    n = torch.tensor([6], dtype=torch.int64)
    assert dist.all_reduce(n, op=dist.ReduceOp.BAND, async_op=True).wait() is None and n.item() == 6
    b = torch.arange(6, dtype=torch.bfloat16).view(2, 3).t()  # not contiguous
    dist.broadcast(b, src=0)
    assert b.tolist() == torch.arange(6, dtype=torch.bfloat16).view(2, 3).t().tolist()
    out = [torch.empty(3)]
    dist.all_gather(out, torch.tensor([1.0, 2.0, 3.0]))
    assert out[0].tolist() == [1.0, 2.0, 3.0]
    whole = torch.empty(1, 2)
    dist.all_gather_into_tensor(whole, torch.tensor([[4.0, 5.0]]))
    assert whole.tolist() == [[4.0, 5.0]]
    objs = [None]
    dist.all_gather_object(objs, {"a": 1})
    assert objs == [{"a": 1}]
    dist.barrier()
    # torch.distributed's default group, over the same MPI group
    assert torch.distributed.get_backend() == "zerompi_mpi" and os.environ["LOCAL_WORLD_SIZE"] == "1"
    assert (torch.distributed.get_rank(), torch.distributed.get_world_size()) == (0, 1)
    u = torch.tensor([3, 4])
    torch.distributed.all_reduce(u, op=torch.distributed.ReduceOp.MAX)
    torch.distributed.barrier()
    assert u.tolist() == [3, 4] and dist.get_rank(group=torch.distributed.group.WORLD) == 0
    with pytest.raises(UsageError, match="only the world group"):
        dist.all_reduce(t, group=object())
    with pytest.raises(UsageError, match="allowed SUM"):
        dist.all_reduce(t, op="median")
    with pytest.raises(UsageError, match="MPI gives this process rank 0"):
        from zerompi.compat.deepspeed import comm
        saved, comm._info = comm._info, None
        try:
            deepspeed.init_distributed(rank=3)
        finally:
            comm._info = saved


def test_log_dist_logs_on_the_ranks_listed(caplog):
    deepspeed.init_distributed()
    with caplog.at_level(logging.INFO, logger="zerompi.deepspeed"):
        deepspeed.utils.log_dist("to rank 0", ranks=[0])
        deepspeed.utils.log_dist("to rank 1", ranks=[1])
        deepspeed.utils.log_dist("to all", ranks=[-1])
        deepspeed.utils.log_dist("to nobody")
    assert [r.getMessage() for r in caplog.records] == ["[Rank 0] to rank 0", "[Rank 0] to all"]
    assert deepspeed.utils.logger.name == "zerompi.deepspeed"


def test_the_logger_is_also_where_deepspeed_keeps_it():
    """``deepspeed.utils.logging.logger``, which Lightning's DeepSpeed strategy sets the level of, is the
    same logger (not the standard library's ``logging`` module, which has no ``logger``)."""
    import zerompi.deepspeed.utils.logging as ds_logging  # noqa: PLC0415  a submodule, as DeepSpeed has it
    assert deepspeed.utils.logging is ds_logging and ds_logging.logger is deepspeed.utils.logger
    level = deepspeed.utils.logger.level
    try:
        deepspeed.utils.logging.logger.setLevel(logging.WARNING)
        assert deepspeed.utils.logger.level == logging.WARNING
    finally:
        deepspeed.utils.logger.setLevel(level)


def test_activation_checkpointing_matches_plain_backward():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    deepspeed.checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
    assert deepspeed.checkpointing.is_configured()
    torch.manual_seed(1)
    deepspeed.checkpointing.checkpoint(block, x).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    torch.manual_seed(1)
    block(x).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(grads, [p.grad for p in block.parameters()] + [x.grad]))
    with pytest.raises(UsageError, match="data parallel only"):
        deepspeed.checkpointing.configure(object())


def test_names_dschat_imports_from_deepspeed():
    """``from deepspeed import get_accelerator``, ``ZeroParamStatus`` (its members by name) and the compression
    helpers' dotted get/set of a submodule, as DeepSpeed-Chat's utils and LoRA code use them."""
    from zerompi.deepspeed import get_accelerator
    from zerompi.deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from zerompi.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    assert get_accelerator is deepspeed.accelerator.get_accelerator
    assert deepspeed.runtime.zero.partition_parameters.ZeroParamStatus is ZeroParamStatus
    assert {s.name for s in ZeroParamStatus} == {"AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"}
    net = nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Tanh(), nn.Linear(3, 1)))
    assert recursive_getattr(net, "1.1") is net[1][1] and recursive_getattr(net, "1.1.weight") is net[1][1].weight
    new = nn.Linear(3, 1)
    recursive_setattr(net, "1.1", new)
    assert net[1][1] is new
    recursive_setattr(net, "0", nn.Identity())
    assert isinstance(net[0], nn.Identity)
    assert not any(hasattr(p, "ds_id") for p in net.parameters())  # zerompi's stage 3 shards buckets, not parameters


_REAL_FIRST = """
import json, sys
import deepspeed, deepspeed.comm, deepspeed.ops.adam, deepspeed.runtime.zero.partition_parameters
real = deepspeed.__version__, sum(n == "deepspeed" or n.startswith("deepspeed.") for n in sys.modules)
from zerompi.compat.deepspeed.runner import install_alias
install_alias()
import deepspeed, deepspeed.comm
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
import zerompi.compat.deepspeed as package
from zerompi.compat.deepspeed.ops import adam
from zerompi.compat.deepspeed.runtime.zero import partition_parameters
left = sorted(n for n, m in sys.modules.items() if (n == "deepspeed" or n.startswith("deepspeed."))
              and not getattr(m, "__name__", "").startswith(package.__name__))
print(json.dumps({"real": real, "left": left, "package": deepspeed is package, "comm": deepspeed.comm is package.comm,
                  "adam": FusedAdam is adam.FusedAdam, "status": ZeroParamStatus is partition_parameters.ZeroParamStatus}))
"""


def test_the_runner_forgets_a_real_deepspeed_imported_before_it():
    """A script that imported real DeepSpeed (0.19.8, on the CPU) before the runner's alias: ``import deepspeed``
    and its submodules then give zerompi's modules, and no module of the real one stays in sys.modules under
    the alias. In a fresh interpreter, so that neither stays in this one.
    Guards: install_alias() leaving the real ``deepspeed`` modules in sys.modules."""
    try:
        importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        unavailable("DeepSpeed", "not installed in the test venv (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-c", _REAL_FIRST], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu",
                              "PYTHONPATH": str(Path(zerompi.__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    version, modules = got.pop("real")
    assert version == "0.19.8" and modules > 100  # the real package and its submodules were loaded
    if "DeepSpeed" not in RAN:
        ran("DeepSpeed", f"deepspeed {version} (test venv)")
    assert got == {"left": [], "package": True, "comm": True, "adam": True, "status": True}


def test_the_runner_answers_for_a_deepspeed_distribution():
    """Under the runner's alias, importlib.metadata finds a ``deepspeed`` distribution (zerompi's API
    version) before any real one, and the frameworks' checks pass; outside it nothing changes. In a
    fresh interpreter, so that the alias stays out of this one."""
    code = ("import importlib.metadata as md, sys\n"
            "from zerompi.compat.deepspeed.runner import install_alias\n"
            "before = [d.metadata['Version'] for d in md.distributions(name='deepspeed')]\n"
            "install_alias()\n"
            "from accelerate.utils import is_deepspeed_available\n"
            "print(before, md.version('deepspeed'), is_deepspeed_available(), md.version('torch') != '')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(zerompi.__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-3000:]
    before, version, available, others = out.stdout.strip().rsplit(" ", 3)
    assert version == "0.19.8+zerompi" and available == "True" and others == "True"
    assert "zerompi" not in before
