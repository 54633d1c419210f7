"""Property-based fuzzing of configuration parsing: ZeroConfig or ConfigError, nothing else.

Inputs are arbitrary JSON-like values (nested dicts/lists, str, int of any size,
float including nan/inf, bool, None), near-valid configs (a valid zerompi or
DeepSpeed document with one key mutated to a random value, a wrong type, a
deleted key or an unknown key), and random text or bytes, fed to
``ZeroConfig.from_dict``, ``zerompi.compat.deepspeed.config_from`` and ``ZeroConfig.from_file``
(TOML and JSON files). The property:

* the result is a valid ``ZeroConfig`` with ``from_dict(cfg.to_dict()) == cfg``, or
* ``ConfigError`` is raised; for a near-valid input its message names the
  mutated key (dotted for DeepSpeed: ``zero_optimization.stage``);
* never any other exception type.

Bugs this fuzzing found, now fixed and kept as regression tests at the end:

* C1: an int too large for a float (``10**400``, legal in JSON and TOML) in a
  float-valued key raised ``OverflowError``;
* C2: a DeepSpeed bucket size whose MiB value underflows to 0 or overflows to
  inf was reported as ``bucket_mb=...`` instead of under the DeepSpeed key;
* C3: a deeply nested JSON/TOML document raised ``RecursionError``.

Set ``ZEROMPI_FUZZ_REPORT=path.json`` to get the counts (section ``config``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.components import require_module  # noqa: E402

require_module("hypothesis")
# The DeepSpeed translation warns about tuning keys with no effect; the property here is the outcome.
pytestmark = pytest.mark.filterwarnings(r"ignore:(DeepSpeed config keys accepted|scheduler\.type=)")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from zerompi.compat.deepspeed import config_from
from zerompi.config import ZeroConfig  # noqa: E402
from zerompi.config.choices import Rounds  # noqa: E402
from zerompi.compat.deepspeed.config import looks_like_deepspeed  # noqa: E402
from zerompi.errors import ConfigError  # noqa: E402

FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                   HealthCheck.data_too_large])
FIELDS = list(ZeroConfig.__dataclass_fields__)
FLOAT_MAX = sys.float_info.max
# Modules whose import has side effects beyond defining names (a dotted optimizer path imports).
_NOISY_MODULES = {"antigravity", "this", "__hello__", "__phello__", "turtle", "tkinter", "idlelib"}

# ---- strategies: arbitrary values -------------------------------------------------------

BIG_INTS = st.sampled_from([2**63, -2**63 - 1, 2**1024, 10**400, -10**400])
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)  # encodable everywhere
KEYS = st.one_of(TEXT, st.sampled_from(FIELDS))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), BIG_INTS,
                    st.floats(allow_nan=True, allow_infinity=True), TEXT)
JSON_VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)), max_leaves=12)
# TOML has no null.
TOML_VALUES = st.recursive(SCALARS.filter(lambda v: v is not None), lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)), max_leaves=12)

# ---- strategies: valid documents ----------------------------------------------------------

_POS = st.floats(min_value=1e-12, max_value=1e6, allow_nan=False, allow_infinity=False)
_NONNEG = st.one_of(st.just(0.0), _POS, st.integers(0, 10**6))
_TAKEN = {"params", "lr", "betas", "eps", "weight_decay", "momentum"}
_KNOWN_VALID = {
    "stage": st.integers(0, 3),
    "optimizer": st.sampled_from(["adamw", "adam", "sgd", "muon", "torch.optim.RMSprop", "torch.optim.Adagrad",
                                  "torch.optim.Adafactor", "torch.optim.Muon"]),
    "optimizer_kwargs": st.dictionaries(TEXT.filter(lambda k: k not in _TAKEN),
                                        st.one_of(st.booleans(), st.integers(-5, 5), _POS), max_size=3),
    "lr": _POS, "betas": st.lists(st.floats(0, 0.999), min_size=2, max_size=2), "eps": _POS,
    "weight_decay": _NONNEG, "momentum": _NONNEG, "grad_accum_steps": st.integers(1, 64),
    "clip_grad_norm": st.one_of(st.none(), _NONNEG), "dtype": st.sampled_from(["fp32", "bf16", "fp16"]),
    "loss_scale": _NONNEG, "initial_scale_power": st.integers(0, 64), "loss_scale_window": st.integers(1, 10**4),
    "hysteresis": st.integers(1, 8), "min_loss_scale": _POS, "bucket_mb": _POS, "seed": st.integers(0, 2**40),
    "cpu_threads": st.one_of(st.none(), st.integers(1, 64)), "device": st.sampled_from(["auto", "cpu", "cuda"]),
    "cuda_aware_mpi": st.sampled_from(["auto", "on", "off"]), "offload_optimizer": st.just("none"),
    "offload_params": st.just("none"), "nvme_path": st.one_of(st.none(), TEXT.filter(bool)),
    "pin_memory": st.booleans(), "return_freed_memory": st.booleans(),
    # needs stage 2-3, no clipping, no fp16, nonfinite='raise': test_fuzz_in_backward
    "optimizer_in_backward": st.just(False), "nonfinite": st.sampled_from(["raise", "skip"]),
    "debug_collectives": st.booleans(), "collective_timeout": st.one_of(st.none(), _POS),
    "abort_on_exception": st.booleans(), "hang_floor": st.one_of(st.none(), _POS),
    "hang_dir": st.one_of(st.none(), TEXT.filter(bool)),
    "checkpoint_layout": st.sampled_from(["auto", "per_rank", "per_node"]),
    # a decaying schedule needs total_steps > warmup_steps and min_lr <= lr: test_fuzz_decaying_schedules
    "param_persistence_threshold": st.just(0), "max_live_params": st.one_of(st.none(), st.integers(1, 10**12)),
    "lr_schedule": st.just("constant"), "warmup_steps": st.integers(0, 10**4),
    "total_steps": st.one_of(st.none(), st.integers(1, 10**6)), "min_lr": st.just(0.0),
    # quantization needs stage 1-3 and error feedback quantized gradients: test_fuzz_quantization
    "quantize_weights": st.just("none"), "quantize_grads": st.just("none"),
    "quant_block": st.integers(1, 32768).map(lambda k: 2 * k), "grad_error_feedback": st.just(False),
    # micro_batches: no fp16, no accumulation; reproducible adds explicit cpu_threads, flat: test_fuzz_reproducible
    "reproducible": st.just(False), "micro_batches": st.just(None),
    "checkpoint_verify": st.booleans(), "checkpoint_direct_io": st.booleans(), "checkpoint_align_kib": st.sampled_from([1 << k for k in range(2, 21)]),
    "checkpoint_async_copy": st.booleans(),
    # needs micro_batches and not the shared layout: test_fuzz_fault_tolerance
    "fault_tolerance": st.just(False), "recovery_every": st.integers(1, 10**6),
    "recovery_source": st.sampled_from(["memory", "disk"]), "buffer_dtype": st.sampled_from(["compute", "model"]),
    "recovery_dir": st.one_of(st.none(), TEXT.filter(bool)), "min_ranks": st.integers(1, 10**6),
}


def _default(name: str):
    f = ZeroConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# A field added later is fuzzed through mutations and kept at its default in valid documents.
VALID_FIELDS = {name: _KNOWN_VALID.get(name, st.just(_default(name))) for name in FIELDS}
VALID_DICTS = st.fixed_dictionaries({}, optional=VALID_FIELDS)


_SIZES = st.one_of(st.integers(1, 10**9), st.floats(1.0, 1e9))
_AUTO = st.just("auto")


def _maybe_auto(draw, strategy):
    """A value from ``strategy``, or "auto" (Hugging Face's templates) a third of the time."""
    return draw(st.one_of(strategy, _AUTO, strategy))


@st.composite
def deepspeed_scheduler(draw) -> dict:
    kind = draw(st.sampled_from(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]))
    params: dict[str, Any] = {}
    if kind != "WarmupLR":
        params["total_num_steps"] = draw(st.integers(1, 10**6))
    if draw(st.booleans()):
        params["warmup_num_steps"] = draw(st.one_of(st.integers(1, 10**4), _AUTO))
    if draw(st.booleans()):
        params["warmup_type"] = draw(st.sampled_from(["log", "linear"]))
    if kind == "WarmupCosineLR":
        for key in ("warmup_min_ratio", "cos_min_ratio"):
            if draw(st.booleans()):
                params[key] = _maybe_auto(draw, st.floats(0, 1))
    else:
        for key in ("warmup_min_lr", "warmup_max_lr"):
            if draw(st.booleans()):
                params[key] = _maybe_auto(draw, _POS)
    return {"type": kind, "params": params}


@st.composite
def valid_deepspeed(draw) -> dict:
    """A DeepSpeed config zerompi accepts (always with two DeepSpeed markers, so that one mutation
    cannot make from_file read it as a zerompi config), "auto" values and tuning keys included."""
    doc: dict[str, Any] = {"train_batch_size": _maybe_auto(draw, st.integers(1, 4096))}
    zero: dict[str, Any] = {}
    if draw(st.booleans()):
        zero["stage"] = draw(st.integers(0, 3))
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if draw(st.booleans()):
            zero[key] = _maybe_auto(draw, _SIZES) if key == "reduce_bucket_size" else draw(_SIZES)
    gather = draw(st.sampled_from(["stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                                   "stage3_gather_fp16_weights_on_model_save"]))  # DeepSpeed 0.19.8's spellings
    for key in ("contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions",
                "round_robin_gradients", "memory_efficient_linear", gather):
        if draw(st.booleans()):
            zero[key] = draw(st.booleans())
    for key in ("sub_group_size", draw(st.sampled_from(["stage3_max_reuse_distance", "max_reuse_distance"])),
                "stage3_model_persistence_threshold"):
        if draw(st.booleans()):
            zero[key] = draw(st.one_of(_SIZES, _AUTO))
    if draw(st.booleans()):
        zero["stage3_prefetch_bucket_size"] = _maybe_auto(draw, st.one_of(st.just(0), _SIZES))
    if draw(st.booleans()):
        zero["stage3_param_persistence_threshold"] = _maybe_auto(draw, st.integers(0, 10**7))
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if draw(st.booleans()):
            zero[key] = draw(st.booleans())
    if draw(st.booleans()):
        zero["zero_hpz_partition_size"] = draw(st.integers(1, 16))
    nvme, pin = draw(st.one_of(st.none(), TEXT.filter(bool))), draw(st.booleans())
    tuning = {"offload_optimizer": {"buffer_count": _SIZES, "pipeline_read": st.booleans(), "fast_init": st.booleans(),
                                    "ratio": st.floats(0, 1)},
              "offload_param": {"buffer_count": _SIZES, "buffer_size": _SIZES, "max_in_cpu": _SIZES}}
    for block in ("offload_optimizer", "offload_param"):
        if draw(st.booleans()):
            zero[block] = {"device": "none", "pin_memory": pin} | ({"nvme_path": nvme} if nvme else {})
            for key, strat in tuning[block].items():
                if draw(st.booleans()):
                    zero[block][key] = draw(strat)
    doc["zero_optimization"] = zero
    if draw(st.booleans()):
        doc["aio"] = draw(st.fixed_dictionaries({}, optional={
            "block_size": st.one_of(st.integers(1, 65536).map(lambda k: 4096 * k), st.integers(1, 2**31)),
            "intra_op_parallelism": st.integers(1, 100), "queue_depth": st.integers(0, 128),
            "thread_count": st.integers(1, 8), "single_submit": st.booleans(), "overlap_events": st.booleans(),
            "use_gds": st.booleans()}))
    for name in ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler"):
        if draw(st.booleans()):
            doc[name] = {"enabled": draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(["compression_training", "data_efficiency", "curriculum_learning",
                                               "autotuning", "hybrid_engine", "torch_autocast", "elasticity",
                                               "progressive_layer_drop"]), max_size=3, unique=True)):
        doc[name] = {"enabled": False}
    if draw(st.booleans()):
        doc["checkpoint"] = draw(st.fixed_dictionaries({}, optional={
            "tag_validation": st.sampled_from(["Ignore", "Warn", "Fail"]), "load_universal": st.just(False),
            "use_node_local_storage": st.just(False), "parallel_write": st.just({"pipeline_stage": False})}))
    if draw(st.booleans()):
        doc["activation_checkpointing"] = {"partition_activations": draw(st.booleans()),
                                           "number_checkpoints": draw(st.integers(1, 8))}
    if draw(st.booleans()):
        doc["gradient_accumulation_steps"] = _maybe_auto(draw, st.integers(1, 64))
    if draw(st.booleans()):
        doc["gradient_clipping"] = _maybe_auto(draw, _NONNEG)
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16", "auto"]))
    if precision in ("bf16", "auto") or draw(st.booleans()):
        bf16 = draw(st.sampled_from(["bf16", "bfloat16"]))  # bfloat16: DeepSpeed's old name of the block
        doc[bf16] = {"enabled": "auto" if precision == "auto" else precision == "bf16"}
        if draw(st.booleans()):
            doc[bf16]["immediate_grad_update"] = draw(st.booleans())
    if precision in ("fp16", "auto") or draw(st.booleans()):
        fp16: dict[str, Any] = {"enabled": "auto" if precision == "auto" else precision == "fp16",
                                "auto_cast": False}
        for key, strat in (("loss_scale", _NONNEG), ("initial_scale_power", st.integers(0, 64)),
                           ("loss_scale_window", st.integers(1, 5000)), ("hysteresis", st.integers(1, 8)),
                           ("min_loss_scale", _POS)):
            if draw(st.booleans()):
                fp16[key] = draw(strat)
        doc["fp16"] = fp16
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["Adam", "AdamW", "SGD", "adamw", "sgd"]))
        params: dict[str, Any] = {"lr": _maybe_auto(draw, _POS)}
        if kind.lower() == "sgd":
            params["momentum"] = _maybe_auto(draw, _NONNEG)
        else:
            params["betas"] = _maybe_auto(draw, st.lists(st.floats(0, 0.999), min_size=2, max_size=2))
            params["eps"] = _maybe_auto(draw, _POS)
            params["adam_w_mode"] = draw(st.booleans())
            for key in ("torch_adam", "bias_correction"):
                if draw(st.booleans()):
                    params[key] = draw(st.booleans())
        params["weight_decay"] = _maybe_auto(draw, _NONNEG)
        doc["optimizer"] = {"type": kind, "params": params}
    if draw(st.booleans()):
        doc["scheduler"] = draw(deepspeed_scheduler())
    for key, strat in (("steps_per_print", st.integers(1, 100)), ("wall_clock_breakdown", st.booleans()),
                       ("prescale_gradients", st.booleans()), ("zero_allow_untested_optimizer", st.booleans()),
                       ("train_micro_batch_size_per_gpu", st.one_of(st.integers(1, 64), _AUTO))):
        if draw(st.booleans()):
            doc[key] = draw(strat)
    # The dtype keys: accepted as the compute dtype (any of DeepSpeed's names for it) or null.
    compute = precision if precision in ("bf16", "fp16") else "fp32"
    names = {"fp32": ["fp32", "float32", "FP32"], "bf16": ["bf16", "bfloat16", "BF16"], "fp16": ["fp16", "half", "float16"]}
    same = st.one_of(st.none(), st.sampled_from(names[compute]))
    if draw(st.booleans()):
        doc["communication_data_type"] = draw(same)
    if draw(st.booleans()):
        doc["data_types"] = draw(st.fixed_dictionaries({}, optional={
            "grad_accum_dtype": same, "param_dtype": same, "buffer_dtype": st.none(),
            "keep_in_fp32_modules": st.sampled_from([None, "auto", []])}))
    if draw(st.booleans()):  # data efficiency that runs no technique: DeepSpeed runs one only under every switch above
        on = draw(st.booleans())
        sampling = {"enabled": draw(st.booleans()) and not on,
                    "curriculum_learning": {"enabled": draw(st.booleans())}}
        doc["data_efficiency"] = {"enabled": on, "seed": draw(st.integers(0, 99)), "data_sampling": sampling}
    if draw(st.booleans()):
        doc["compile"] = draw(st.fixed_dictionaries({}, optional={
            "deepcompile": st.just(False), "offload_activation": st.booleans(), "free_activation": st.booleans(),
            "double_buffer": st.booleans(), "sync_before_reduce": st.booleans()}))
    return doc


# ---- mutations -----------------------------------------------------------------------------

def _paths(doc: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested dict, blocks and leaves."""
    out = []
    for k, v in doc.items():
        out.append(prefix + (k,))
        if isinstance(v, dict):
            out += _paths(v, prefix + (k,))
    return out


def _blocks(doc: dict, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    for k, v in doc.items():
        if isinstance(v, dict):
            out += _blocks(v, prefix + (k,))
    return out


EDGE_NUMBERS = st.sampled_from([0, -1, 1, 5e-324, 1e-320, 1e308, FLOAT_MAX, -FLOAT_MAX, 2**53 + 1, 2**63,
                                10**400, -10**400, -0.0, float("nan"), float("inf")])
WRONG_TYPES = st.sampled_from(["3", "true", "", [], {}, [1, 2, 3], {"x": 1}, -1, 0, 1.5, -0.0, True, False,
                               float("nan"), float("inf"), -float("inf"), 10**400, 2**64, None])


@st.composite
def mutated(draw, base: st.SearchStrategy, values: st.SearchStrategy, nested: bool):
    """(document, dotted key, how): one key of a valid document replaced, deleted or added."""
    doc = json.loads(json.dumps(draw(base)))  # a deep copy (keeps nan/inf)
    how = draw(st.sampled_from(["random value", "wrong type", "edge number", "unknown key", "delete"]))
    if how == "unknown key" or not _paths(doc):
        where = draw(st.sampled_from(_blocks(doc))) if nested else ()
        node = doc
        for k in where:
            node = node[k]
        key = draw(TEXT.filter(lambda k: k not in node and "." not in k and k.strip() == k and k))
        assume(key not in FIELDS or nested)
        node[key] = draw(values)
        return doc, ".".join((*where, key)), "unknown key"
    path = draw(st.sampled_from(_paths(doc) if nested else [(k,) for k in doc]))
    node = doc
    for k in path[:-1]:
        node = node[k]
    if how == "delete":
        del node[path[-1]]
    else:
        node[path[-1]] = draw({"random value": values, "wrong type": WRONG_TYPES, "edge number": EDGE_NUMBERS}[how])
    return doc, ".".join(path), how


def names_key(message: str, dotted: str) -> bool:
    """Whether the message names ``dotted`` as a whole key (or a key inside it)."""
    return re.search(rf"(?<![\w.]){re.escape(dotted)}(?!\w)", message) is not None


# ---- outcome checking, known-bug signatures, counts ---------------------------------------

COUNTS: dict[str, Counter] = defaultdict(Counter)


def _has_big_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) > FLOAT_MAX
    if isinstance(value, dict):
        return any(_has_big_int(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_big_int(v) for v in value)
    return False


def _big_int_in_text(text: str) -> bool:
    return re.search(r"(?<![\d.eE+-])[-+]?\d{309,}(?![\d.eE])", text) is not None


def _nesting(text: str) -> int:
    depth = best = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return best


def judge(test: str, call, *, key: str | None = None, big_int: bool = False, deep: bool = False,
          key_ok=None) -> ZeroConfig | None:
    """Run ``call``; assert the property; count the outcome; return the config (or None)."""
    try:
        cfg = call()
    except ConfigError as e:
        msg = str(e)
        if key is None or names_key(msg, key) or (key_ok is not None and key_ok(msg)):
            COUNTS[test]["config_error"] += 1
            return None
        raise AssertionError(f"ConfigError does not name the mutated key {key!r}: {msg}") from e
    assert isinstance(cfg, ZeroConfig)
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg, cfg
    COUNTS[test]["valid"] += 1
    return cfg


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    path = os.environ.get("ZEROMPI_FUZZ_REPORT")
    if not path:
        return
    total = Counter()
    for c in COUNTS.values():
        total.update(c)
    p = Path(path)
    doc = json.loads(p.read_text()) if p.exists() and p.stat().st_size else {}
    doc["config"] = {"total": dict(total), "tried": sum(total.values()),
                     "by_test": {k: dict(v) for k, v in sorted(COUNTS.items())}}
    p.write_text(json.dumps(doc, indent=1, sort_keys=True))


# ---- file writers -------------------------------------------------------------------------------

def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_str(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML for {v!r}")


def toml_document(doc: dict) -> str:
    return "".join(f"{_toml_str(str(k))} = {toml_value(v)}\n" for k, v in doc.items())


def _without_none(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _without_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_without_none(x) for x in v if x is not None]
    return v


_file_seq = [0]


def write_doc(tmp: Path, text: str | bytes, suffix: str) -> Path:
    _file_seq[0] += 1
    path = tmp / f"c{_file_seq[0]:05d}{suffix}"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzzconfig")


def _safe_optimizer(doc: Any) -> bool:
    """No import with side effects: a dotted optimizer path imports its module."""
    opt = doc.get("optimizer") if isinstance(doc, dict) else None
    if isinstance(opt, str) and "." in opt:
        return opt.split(".")[0] not in _NOISY_MODULES
    return True


# ---- from_dict ------------------------------------------------------------------------------------

ARBITRARY_DICTS = st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
                            st.dictionaries(st.sampled_from(FIELDS), SCALARS, max_size=3))


@settings(max_examples=200, **FUZZ)
@given(ARBITRARY_DICTS)
def test_fuzz_from_dict_arbitrary(value):
    assume(_safe_optimizer(value))
    judge("from_dict/arbitrary", lambda: ZeroConfig.from_dict(value), big_int=_has_big_int(value))


@settings(max_examples=250, **FUZZ)
@given(mutated(VALID_DICTS, JSON_VALUES, nested=False))
def test_fuzz_from_dict_near_valid(case):
    doc, key, _how = case
    assume(_safe_optimizer(doc))
    judge("from_dict/near_valid", lambda: ZeroConfig.from_dict(doc), key=key, big_int=_has_big_int(doc))


@settings(max_examples=100, **FUZZ)
@given(VALID_DICTS)
def test_fuzz_valid_dicts_round_trip(doc):
    cfg = judge("from_dict/valid", lambda: ZeroConfig.from_dict(doc))
    assert cfg is not None, "a valid document was refused"
    json.dumps(cfg.to_dict())  # "a plain dict that from_dict accepts and JSON can hold"


@settings(max_examples=100, **FUZZ)
@given(st.sampled_from(["warmup_cosine", "warmup_linear"]), st.integers(0, 10**4), st.integers(1, 10**4),
       _POS, st.floats(0, 1))
def test_fuzz_decaying_schedules(schedule, warmup, more, lr, fraction):
    doc = dict(lr_schedule=schedule, warmup_steps=warmup, total_steps=warmup + more, lr=lr, min_lr=lr * fraction)
    cfg = judge("from_dict/schedule", lambda: ZeroConfig.from_dict(doc))
    assert cfg is not None and ZeroConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (dict(total_steps=warmup), dict(min_lr=lr * 2 + 1), dict(total_steps=None)):
        with pytest.raises(ConfigError, match="total_steps|min_lr"):
            ZeroConfig.from_dict({**doc, **bad})


@settings(max_examples=100, **FUZZ)
@given(st.integers(1, 3), st.sampled_from(["none", "int8"]), st.sampled_from(["none", "int8", "int4"]),
       st.integers(1, 32768), st.booleans())
def test_fuzz_quantization(stage, weights, grads, half_block, feedback):
    feedback = feedback and grads != "none"
    doc = dict(stage=stage, quantize_weights=weights, quantize_grads=grads, quant_block=2 * half_block,
               grad_error_feedback=feedback)
    cfg = judge("from_dict/quantization", lambda: ZeroConfig.from_dict(doc))
    assert cfg is not None and cfg.compression.block == 2 * half_block
    for bad, key in ((dict(stage=0, quantize_weights="int8"), "quantize_weights"),
                     (dict(stage=0, quantize_weights="none", quantize_grads="int8"), "quantize_grads"),
                     (dict(quantize_grads="none", grad_error_feedback=True), "grad_error_feedback"),
                     (dict(quant_block=2 * half_block + 1), "quant_block")):
        with pytest.raises(ConfigError, match=key):
            ZeroConfig.from_dict({**doc, **bad})


@settings(max_examples=100, **FUZZ)
@given(st.integers(0, 3), st.one_of(st.none(), st.integers(1, 64)), st.sampled_from(["fp32", "bf16", "fp16"]),
       st.one_of(st.none(), st.integers(1, 8)), st.integers(1, 4), st.sampled_from(["flat", "hsdp"]),
       st.sampled_from(["none", "int8"]), st.sampled_from(["none", "cpu", "nvme"]), st.booleans(), st.booleans())
def test_fuzz_reproducible(stage, micro, dtype, threads, accum, hierarchy, quant, offload, in_backward, bitwise):
    """micro_batches with reproducible=True (bitwise) or alone: the same structural refusals, and the bitwise
    ones (threads, hsdp) only with reproducible=True."""
    doc = dict(stage=stage, reproducible=bitwise, micro_batches=micro, dtype=dtype, cpu_threads=threads,
               grad_accum_steps=accum, hierarchy=hierarchy, quantize_grads=quant if stage else "none",
               offload_optimizer=offload, nvme_path="/tmp" if offload == "nvme" else None,
               optimizer_in_backward=in_backward and stage >= 2)
    dealt = micro is not None
    wrong = {"micro_batches": bitwise and micro is None, "grad_accum_steps": dealt and accum != 1,
             "offload_optimizer": offload != "none" and stage == 0, "dtype": dealt and dtype == "fp16",
             "hierarchy": bitwise and hierarchy != "flat",
             "quantize_grads": dealt and quant != "none" and stage > 0, "cpu_threads": bitwise and threads is None,
             "optimizer_in_backward": in_backward and stage >= 2 and dealt}
    if in_backward and stage >= 2 and dtype == "fp16":
        wrong = {"optimizer_in_backward": True}  # refused first by its own check
    if not any(wrong.values()):
        cfg = judge("from_dict/reproducible", lambda: ZeroConfig.from_dict(doc))
        assert cfg is not None and cfg.reproducible == bitwise and cfg.optimization.deterministic == bitwise
        assert cfg.rounds == (Rounds.ORDERED if bitwise else Rounds.SUMMED if dealt else Rounds.WINDOW)
        return
    with pytest.raises(ConfigError) as e:
        ZeroConfig.from_dict(doc)
    # the error names a wrong setting (another check may name one first: offload or quantization at stage 0)
    named = [k for k, bad in wrong.items() if bad] + (["stage=0"] if stage == 0 else [])
    assert any(k in str(e.value) for k in named), (named, str(e.value))


@settings(max_examples=60, **FUZZ)
@given(st.sampled_from(["none", "micro_batches", "reproducible"]), st.sampled_from(["auto", "per_rank", "shared"]),
       st.integers(-2, 4), st.integers(-2, 4), st.one_of(st.none(), st.just(""), st.just("/tmp/recovery")),
       st.sampled_from(["memory", "disk", "buddy", 0]), st.sampled_from(["none", "cpu", "nvme"]))
def test_fuzz_fault_tolerance(batch, layout, every, least, directory, source, offload):
    doc = dict(fault_tolerance=True, checkpoint_layout=layout, recovery_every=every, min_ranks=least,
               recovery_dir=directory, recovery_source=source, stage=3, offload_optimizer=offload,
               nvme_path="/tmp/swap")
    if batch != "none":
        doc.update(micro_batches=4)
    if batch == "reproducible":
        doc.update(reproducible=True, cpu_threads=1)
    wrong = {"recovery_every": every < 1, "recovery_source": source not in ("memory", "disk"),
             "recovery_dir": directory == "", "min_ranks": least < 1, "micro_batches": batch == "none",
             "checkpoint_layout": layout == "shared",
             "recovery_source='memory'": source == "memory" and offload == "nvme"}
    if not any(wrong.values()):
        cfg = judge("from_dict/fault_tolerance", lambda: ZeroConfig.from_dict(doc))
        assert cfg is not None and cfg.fault_tolerance
        return
    with pytest.raises(ConfigError) as e:
        ZeroConfig.from_dict(doc)
    first = next(k for k, bad in wrong.items() if bad)  # fields first, in field order; then the cross-field rules
    assert first in str(e.value), (first, str(e.value))


def test_micro_batches_deal_the_batch_with_or_without_reproducible():
    assert ZeroConfig(micro_batches=4).rounds == Rounds.SUMMED
    assert ZeroConfig(micro_batches=4, reproducible=True, cpu_threads=1).rounds == Rounds.ORDERED
    assert ZeroConfig().rounds == Rounds.WINDOW
    ZeroConfig(micro_batches=4, optimizer_kwargs={"foreach": True})  # kernels change only the bits
    with pytest.raises(ConfigError, match=r"micro_batches=4 cannot keep its guarantee with: grad_accum_steps=2"):
        ZeroConfig(micro_batches=4, grad_accum_steps=2)
    with pytest.raises(ConfigError, match="reproducible=True needs micro_batches"):
        ZeroConfig(reproducible=True, cpu_threads=1)


@settings(max_examples=100, **FUZZ)
@given(st.integers(0, 3), st.one_of(st.none(), st.floats(0, 10)), st.sampled_from(["fp32", "bf16", "fp16"]),
       st.sampled_from(["raise", "skip"]), st.integers(1, 8))
def test_fuzz_in_backward(stage, clip, dtype, nonfinite, accum):
    doc = dict(stage=stage, clip_grad_norm=clip, dtype=dtype, nonfinite=nonfinite, grad_accum_steps=accum,
               optimizer_in_backward=True)
    allowed = stage >= 2 and not clip and dtype != "fp16" and nonfinite == "raise"
    if allowed:
        assert judge("from_dict/in_backward", lambda: ZeroConfig.from_dict(doc)).optimizer_in_backward
    else:
        with pytest.raises(ConfigError, match="optimizer_in_backward=True"):
            ZeroConfig.from_dict(doc)


# ---- from_deepspeed ----------------------------------------------------------------------------------

@settings(max_examples=200, **FUZZ)
@given(st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(
    ["zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "gradient_clipping", "gradient_accumulation_steps",
     "train_batch_size", "aio", "tensorboard", "pipeline", "curriculum_learning", "tensor_parallel", "checkpoint"]),
     JSON_VALUES,
    max_size=5), st.fixed_dictionaries({}, optional={
         "zero_optimization": st.dictionaries(st.sampled_from(["stage", "reduce_bucket_size"]), SCALARS),
         "gradient_clipping": SCALARS, "gradient_accumulation_steps": SCALARS,
         "fp16": st.dictionaries(st.sampled_from(["enabled", "loss_scale", "min_loss_scale"]), SCALARS)})))
def test_fuzz_from_deepspeed_arbitrary(value):
    judge("from_deepspeed/arbitrary", lambda: config_from(value), big_int=_has_big_int(value))


@settings(max_examples=250, **FUZZ)
@given(mutated(valid_deepspeed(), JSON_VALUES, nested=True))
def test_fuzz_from_deepspeed_near_valid(case):
    doc, key, _how = case
    judge("from_deepspeed/near_valid", lambda: config_from(doc), key=key,
          big_int=_has_big_int(doc))


@settings(max_examples=60, **FUZZ)
@given(valid_deepspeed())
def test_fuzz_valid_deepspeed_configs_load(doc):
    assert judge("from_deepspeed/valid", lambda: config_from(doc)) is not None


# ---- from_file ---------------------------------------------------------------------------------------

DEEP = st.builds(lambda n, open_, close, prefix: prefix + open_ * n + close * n,
                 st.integers(100, 5000), st.sampled_from(["[", "{\"a\":"]), st.sampled_from(["]", "}"]),
                 st.sampled_from(["", "x = ", "{\"optimizer_kwargs\": "]))
RANDOM_TEXT = st.one_of(st.text(max_size=200), st.binary(max_size=200),
                        st.builds(json.dumps, JSON_VALUES),
                        st.builds(lambda d: toml_document(d) if isinstance(d, dict) else "",
                                  st.dictionaries(KEYS, TOML_VALUES, max_size=5)),
                        DEEP)


@settings(max_examples=150, **FUZZ)
@given(text=RANDOM_TEXT, suffix=st.sampled_from([".toml", ".json", ".toml", ".json", ".JSON", ".txt"]))
def test_fuzz_from_file_random_text(tmp, text, suffix):
    path = write_doc(tmp, text, suffix)
    raw = text.decode("latin-1") if isinstance(text, bytes) else text
    assume(_safe_optimizer(_try_parse(raw)))
    judge("from_file/random_text", lambda: ZeroConfig.from_file(path), big_int=_big_int_in_text(raw),
          deep=_nesting(raw) >= 100)


def _try_parse(text: str) -> Any:
    try:
        return json.loads(text)
    except Exception:  # noqa: BLE001 - not JSON: TOML or junk
        return None


@settings(max_examples=200, **FUZZ)
@given(case=st.one_of(mutated(VALID_DICTS, TOML_VALUES, nested=False),
                      mutated(valid_deepspeed(), TOML_VALUES, nested=True)),
       suffix=st.sampled_from([".toml", ".json"]))
def test_fuzz_from_file_near_valid(tmp, case, suffix):
    doc, key, _how = case
    assume(_safe_optimizer(doc))
    if suffix == ".toml":
        doc = _without_none(doc)  # TOML has no null: a None value becomes a deleted key
    text = toml_document(doc) if suffix == ".toml" else json.dumps(doc)
    path = write_doc(tmp, text, suffix)
    native = not looks_like_deepspeed({k: v for k, v in doc.items() if k != key.split(".")[0]})

    def switched_reading(msg: str) -> bool:
        # The mutation made a zerompi document look like a DeepSpeed one (or the reverse): the
        # message says how it was read, and names keys under that reading.
        return native and "(read as a DeepSpeed config)" in msg

    judge(f"from_file/near_valid{suffix}", lambda: ZeroConfig.from_file(path), key=key, big_int=_has_big_int(doc),
          key_ok=switched_reading)


# ---- regressions of bugs the fuzzing found ---------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda tmp: ZeroConfig.from_dict({"lr": 10**400}),
    lambda tmp: ZeroConfig(weight_decay=-10**400),
    lambda tmp: config_from({"gradient_clipping": 10**400}),
    lambda tmp: config_from({"zero_optimization": {"reduce_bucket_size": 10**400}}),
    lambda tmp: ZeroConfig.from_file(write_doc(tmp, '{"lr": 1' + "0" * 400 + "}", ".json")),
    lambda tmp: ZeroConfig.from_file(write_doc(tmp, "lr = 1" + "0" * 400 + "\n", ".toml")),
], ids=["from_dict", "kwargs", "deepspeed-clipping", "deepspeed-bucket", "json-file", "toml-file"])
def test_c1_huge_int_is_a_config_error(tmp, call):
    with pytest.raises(ConfigError):
        call(tmp)


@pytest.mark.parametrize("value", [1e308, -1e-320, float("nan")])
def test_c2_deepspeed_bucket_size_error_names_the_deepspeed_key(value):
    with pytest.raises(ConfigError, match=r"zero_optimization\.reduce_bucket_size"):
        config_from({"zero_optimization": {"reduce_bucket_size": value}})


@pytest.mark.parametrize("value", [0, 1e-320, 0.5])
def test_c2_deepspeed_bucket_below_one_element_is_a_bucket_per_parameter(value):
    """DeepSpeed takes int(size): below one element it flushes before every parameter."""
    assert config_from({"zero_optimization": {"reduce_bucket_size": value}}).bucket_numel(4) == 1


@pytest.mark.parametrize("name,text", [("deep.json", "[" * 100000 + "]" * 100000),
                                       ("deep.toml", "x = " + "[" * 100000 + "]" * 100000)])
def test_c3_deeply_nested_file_is_a_config_error(tmp, name, text):
    path = tmp / name
    path.write_text(text)
    with pytest.raises(ConfigError):
        ZeroConfig.from_file(path)
