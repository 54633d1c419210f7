"""The config's enums, its plain to_dict, the grouped policies, and its import graph."""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import zerompi.config
from zerompi.compat.deepspeed import config_from
from zerompi.config import (UpdateSchedule, CheckpointLayout, CudaAware, Device, DType, Hierarchy, NonFinite, Offload,
                            OffloadPolicy, OverlapPolicy, PrecisionPolicy, Progress, ReliabilityPolicy, Stage,
                            TopologyPolicy, ZeroConfig)
from zerompi.config.zero import SECTIONS
from zerompi.errors import ConfigError

# Each choice field, its enum and its allowed values exactly as a config spells them.
CHOICE_FIELDS = [
    ("dtype", DType, ("fp32", "bf16", "fp16")),
    ("device", Device, ("auto", "cpu", "cuda")),
    ("cuda_aware_mpi", CudaAware, ("auto", "on", "off")),
    ("offload_optimizer", Offload, ("none", "cpu", "nvme")),
    ("offload_params", Offload, ("none", "cpu", "nvme")),
    ("mpi_progress", Progress, ("none", "test", "thread")),
    ("hierarchy", Hierarchy, ("flat", "hsdp", "hpz")),
    ("nonfinite", NonFinite, ("raise", "skip")),
    ("checkpoint_layout", CheckpointLayout, ("auto", "per_rank", "shared", "per_node")),
]
# Cross-field rules some values need to be accepted.
_NEEDS = {"offload_optimizer": dict(stage=3, nvme_path="/tmp"),
          "offload_params": dict(stage=3, nvme_path="/tmp")}


# --- enums ----------------------------------------------------------------------------

@pytest.mark.parametrize("key,kind,values", CHOICE_FIELDS)
def test_choice_parses_each_value_into_its_member(key, kind, values):
    assert kind.values() == values
    for value in values:
        got = getattr(ZeroConfig(**{key: value}, **_NEEDS.get(key, {})), key)
        assert type(got) is kind and got is kind(value)
        assert got == value and hash(got) == hash(value) and str(got) == value and repr(got) == repr(value)


@pytest.mark.parametrize("key,kind,values", CHOICE_FIELDS)
@pytest.mark.parametrize("bad", ["FP32", "", "other", 1, None, b"cpu"])
def test_choice_rejects_others_naming_key_and_allowed_values(key, kind, values, bad):
    with pytest.raises(ConfigError) as err:
        ZeroConfig(**{key: bad})
    allowed = ", ".join(repr(v) for v in values)
    assert str(err.value) == f"{key}={bad!r} is not one of {allowed}"


def test_choice_takes_members_too():
    cfg = ZeroConfig(dtype=DType.BF16, hierarchy=Hierarchy.HSDP, stage=Stage.GRADIENTS)
    assert cfg == ZeroConfig(dtype="bf16", hierarchy="hsdp", stage=2)


@pytest.mark.parametrize("value", [0, 1, 2, 3])
def test_stage_parses_ints(value):
    stage = ZeroConfig(stage=value).stage
    assert type(stage) is Stage and stage == value and str(stage) == str(value) and repr(stage) == repr(value)


@pytest.mark.parametrize("bad", [-1, 4, 1.0, "3", True, None])
def test_stage_rejects_others(bad):
    with pytest.raises(ConfigError, match=rf"^stage={bad!r} is not an int in 0\.\.3$"):
        ZeroConfig(stage=bad)


def test_stage_says_what_it_shards():
    table = {s: (s.shards_optimizer, s.shards_grads, s.shards_params) for s in Stage}
    assert table == {Stage.REPLICATED: (False, False, False), Stage.OPTIMIZER: (True, False, False),
                     Stage.GRADIENTS: (True, True, False), Stage.PARAMETERS: (True, True, True)}


def test_dtype_properties():
    assert [d.torch for d in DType] == [torch.float32, torch.bfloat16, torch.float16]
    assert [d.is_16bit for d in DType] == [False, True, True]
    assert ZeroConfig(dtype="bf16").torch_dtype is torch.bfloat16


def test_messages_read_as_before_with_members():
    # Other modules format config values with !r; a member shows as its plain value.
    cfg = ZeroConfig(stage=2, dtype="fp16", hierarchy="hsdp")
    assert f"{cfg.hierarchy!r} {cfg.dtype} {cfg.stage} {cfg.stage!r}" == "'hsdp' fp16 2 2"
    assert "stage=2" in repr(cfg) and "dtype='fp16'" in repr(cfg)


# --- to_dict: plain values --------------------------------------------------------------

def test_to_dict_holds_plain_types():
    cfg = ZeroConfig(stage=2, dtype="bf16", offload_optimizer="nvme", nvme_path="/tmp", mpi_progress="test",
                     hierarchy="hsdp", nonfinite="skip", checkpoint_layout="per_rank")
    d = cfg.to_dict()
    plain = (str, int, float, bool, type(None), list, dict)
    assert all(type(v) in plain for v in d.values()), {k: type(v) for k, v in d.items()}
    assert type(d["stage"]) is int and d["stage"] == 2
    assert json.loads(json.dumps(d)) == d
    assert ZeroConfig.from_dict(d) == cfg
    assert ZeroConfig.from_dict(d).to_dict() == d


def test_replace_keeps_members():
    cfg = ZeroConfig(dtype="fp16").replace(seed=3)
    assert cfg.dtype is DType.FP16 and cfg.stage is Stage.PARAMETERS


def test_from_deepspeed_gives_members():
    cfg = config_from({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                     "bf16": {"enabled": True}})
    assert (cfg.stage, cfg.dtype, cfg.offload_optimizer) == (Stage.GRADIENTS, DType.BF16, Offload.CPU)
    assert type(cfg.stage) is Stage and type(cfg.dtype) is DType and type(cfg.offload_optimizer) is Offload


# --- policies ---------------------------------------------------------------------------

def test_precision_policy():
    cfg = ZeroConfig(dtype="fp16", loss_scale=0, initial_scale_power=12, loss_scale_window=50, hysteresis=3,
                     min_loss_scale=0.5)
    p = cfg.precision
    assert p == PrecisionPolicy(DType.FP16, 0.0, 12, 50, 3, 0.5)
    assert p.torch_dtype is torch.float16 and p.scales_loss and p.dynamic_scale
    assert not ZeroConfig(dtype="fp16", loss_scale=128).precision.dynamic_scale
    assert not ZeroConfig(dtype="bf16").precision.scales_loss


def test_offload_policy():
    cfg = ZeroConfig(stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path="/scratch",
                     pin_memory=False, nvme_block_kib=64, nvme_threads=2, nvme_buffers=5, nvme_verify=False)
    o = cfg.offload
    assert o == OffloadPolicy(Offload.NVME, Offload.CPU, "/scratch", False, 64, 2, 5, False)
    assert o.uses_nvme and o.uses_cpu and o.active
    none = ZeroConfig().offload
    assert (none.optimizer, none.params, none.uses_nvme, none.uses_cpu, none.active) == (
        Offload.NONE, Offload.NONE, False, False, False)
    assert ZeroConfig(stage=3, offload_params="nvme", nvme_path="/x").offload.uses_nvme


def test_overlap_topology_reliability_policies():
    cfg = ZeroConfig(overlap_grad_reduce=True, prefetch_units=2, mpi_progress="thread", hierarchy="hpz",
                     ranks_per_node=4, nonfinite="skip", debug_collectives=True, collective_timeout=30,
                     abort_on_exception=False, hang_floor=5, hang_dir="/tmp/records")
    assert cfg.overlap == OverlapPolicy(True, 2, Progress.THREAD, UpdateSchedule.AFTER_BACKWARD)
    assert ZeroConfig(stage=2, optimizer_in_backward=True).overlap.update is UpdateSchedule.IN_BACKWARD
    assert cfg.topology == TopologyPolicy(Hierarchy.HPZ, 4) and not cfg.topology.is_flat
    assert ZeroConfig().topology.is_flat
    assert cfg.reliability == ReliabilityPolicy(True, 30.0, False, 5.0, "/tmp/records")
    assert ZeroConfig().reliability.hang_floor == 60.0 and ZeroConfig().reliability.hang_dir is None
    assert cfg.optimization.nonfinite is NonFinite.SKIP


POLICIES = ("sharding", "topology", "optimization", "lr_policy", "batch", "precision", "runtime", "offload",
            "overlap", "compression", "checkpointing", "reliability", "recovery")


@pytest.mark.parametrize("group", POLICIES)
def test_policies_are_frozen_and_built_once(group):
    cfg = ZeroConfig()
    view = getattr(cfg, group)
    assert getattr(cfg, group) is view  # built once, not on each access
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(view, dataclasses.fields(view)[0].name, None)


# A policy attribute's key where the names differ.
RENAMED = {"sharding": {"persistence_threshold": "param_persistence_threshold"},
           "offload": {"optimizer": "offload_optimizer", "params": "offload_params", "block_kib": "nvme_block_kib",
                       "threads": "nvme_threads", "buffers": "nvme_buffers", "verify": "nvme_verify"},
           "overlap": {"grad_reduce": "overlap_grad_reduce", "progress": "mpi_progress",
                       "update": "optimizer_in_backward"},
           "optimization": {"kwargs": "optimizer_kwargs", "deterministic": "reproducible"},
           "lr_policy": {"schedule": "lr_schedule"},
           "compression": {"weights": "quantize_weights", "grads": "quantize_grads", "block": "quant_block",
                           "error_feedback": "grad_error_feedback"},
           "checkpointing": {"layout": "checkpoint_layout", "verify": "checkpoint_verify",
                             "direct_io": "checkpoint_direct_io", "align_kib": "checkpoint_align_kib",
                             "async_copy": "checkpoint_async_copy"},
           "recovery": {"enabled": "fault_tolerance", "every": "recovery_every", "source": "recovery_source",
                        "directory": "recovery_dir"}}


def test_every_key_is_in_one_section_and_read_by_its_policies():
    cfg = ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="nvme", nvme_path="/p", prefetch_units=3)
    declared = {}
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            assert f.name not in declared, f"{f.name} in {declared.get(f.name)} and {section.__name__}"
            declared[f.name] = section
    assert set(declared) == {f.name for f in dataclasses.fields(ZeroConfig)}
    read = {}
    for group in POLICIES:
        view = getattr(cfg, group)
        for f in dataclasses.fields(view):
            key = RENAMED.get(group, {}).get(f.name, f.name)
            value = getattr(view, f.name)
            if isinstance(value, UpdateSchedule):  # the schedule a bool key chooses
                value = value is UpdateSchedule.IN_BACKWARD
            assert value == getattr(cfg, key), (group, f.name)
            read.setdefault(key, []).append(group)
    assert set(read) == set(declared)  # no key that no policy reads
    # Read twice: lr by the optimizer and by the schedule (min_lr's reference); reproducible by the batch
    # section and by the optimizer, whose kernel it picks.
    assert {k: v for k, v in read.items() if len(v) > 1} == {
        "lr": ["optimization", "lr_policy"], "reproducible": ["optimization", "batch"]}


# --- import graph -----------------------------------------------------------------------

def _config_import_graph() -> dict[str, set[str]]:
    """Module -> zerompi modules it imports, from every import statement in zerompi/config
    (including those inside functions, which is where a cycle would hide)."""
    folder = Path(zerompi.config.__file__).parent
    pkg = "zerompi.config"
    submodules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {"sections"}
    graph: dict[str, set[str]] = {}
    for py in folder.rglob("*.py"):
        parts = py.relative_to(folder).with_suffix("").parts
        name = ".".join((pkg, *parts[:-1], *parts[-1:])) if parts[-1] != "__init__" else ".".join((pkg, *parts[:-1]))
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(py.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.startswith("zerompi"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zerompi"):
                if node.module == pkg:  # `from zerompi.config import checks` names a submodule
                    edges.update(f"{pkg}.{a.name}" if a.name in submodules else pkg for a in node.names)
                else:
                    edges.add(node.module)
    return graph


def test_config_imports_have_no_cycle():
    graph = _config_import_graph()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, "import cycle: " + " -> ".join((*path, module))
        if module in done or module not in graph:
            return
        for dep in sorted(graph[module]):
            visit(dep, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def test_config_depends_only_on_itself_and_errors():
    outside = {dep for deps in _config_import_graph().values() for dep in deps
               if not dep.startswith("zerompi.config")}
    assert outside == {"zerompi.errors"}


def test_config_knows_no_dialect():
    """DeepSpeed lives in zerompi/compat/deepspeed; the config only offers dialects a registry."""
    folder = Path(zerompi.config.__file__).parent
    for py in folder.rglob("*.py"):
        code = ast.parse(py.read_text(encoding="utf-8"))
        names = {n.id for n in ast.walk(code) if isinstance(n, ast.Name)} | \
            {n.attr for n in ast.walk(code) if isinstance(n, ast.Attribute)}
        assert not {n for n in names if "deepspeed" in n.lower()}, py.name


def test_compat_uses_public_validators_only():
    folder = Path(zerompi.config.__file__).parent.parent / "compat" / "deepspeed"
    for py in folder.glob("*.py"):
        for node in ast.walk(ast.parse(py.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zerompi.config"):
                assert not [a.name for a in node.names if a.name.startswith("_")], py.name
