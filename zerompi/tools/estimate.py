"""Model-state memory and communication per rank for each ZeRO stage, before any run.

Ψ parameters on N data-parallel ranks, c bytes per compute element (4 for fp32,
2 for bf16/fp16), K optimizer bytes per parameter: the optimizer's fp32 state
(Adam: two moments, 8 bytes; SGD with momentum: 4) plus, in 16-bit training,
the 4-byte fp32 master copy (so K = 12 for Adam, the ZeRO paper's value)::

    stage 0  (c + c + K) Ψ          all-reduce                  2Ψ(N-1)/N
    stage 1  c Ψ + c Ψ + K Ψ/N      reduce-scatter + all-gather 2Ψ(N-1)/N
    stage 2  c Ψ + (c + K) Ψ/N      reduce-scatter + all-gather 2Ψ(N-1)/N
    stage 3  (c + c + K) Ψ/N        all-gather x2 + reduce-scatter 3Ψ(N-1)/N

Frozen parameters (``--frozen-params`` Ψ_f: a fine-tuned base) take c bytes
each and nothing else: c Ψ_f at stages 0-2, where they are replicated and never
communicated, c Ψ_f/N at stage 3, where they are sharded and all-gathered with
the rest in forward and backward (2Ψ_f(N-1)/N more per step) and never reduced.

(Rajbhandari et al., "ZeRO", 2019, section 5 and Table 1; communication in
elements sent per rank per optimizer step, section 7.) A sharded term holds
``ceil(Ψ/N)`` elements per rank. The engine pads every bucket to a multiple of
N, so ``engine.stats.model_state_bytes`` equals :func:`model_state_bytes` at
Ψ = the sum of the buckets' ``padded_numel``. Offload (``cpu``, ``nvme``) moves
the K term, optimizer state and master, off the device. Activations, stage 3's
gathered parameters and communication buffers are not model states and are
not counted.

``zerompi estimate`` prints these for a parameter count or for the GPT of a
job config, for one or several world sizes (see :func:`register`).
"""
from __future__ import annotations

import argparse
import json
import math
import tomllib
from typing import Any, NamedTuple

from zerompi.errors import ConfigError
from zerompi.shard.stages import PLANS, StagePlan, plan_for
from zerompi.tools import commtime
from zerompi.tools.counts import parse_count, parse_ranks  # noqa: F401 (part of this module's API)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# fp32 optimizer state per parameter; the fp32 master of 16-bit training comes on top.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "sgd-nomomentum": 0}
OFFLOAD = ("none", "cpu", "nvme")
STAGE_NAMES = ("baseline DP", "P_os", "P_os+g", "P_os+g+p")
MASTER_BYTES = 4
GB, GIB = 10**9, 2**30


class MemoryEstimate(NamedTuple):
    """Model-state bytes held by one rank at one stage."""

    params: int
    ranks: int
    stage: int
    offload: str
    parameters: int       # compute-dtype parameters
    gradients: int        # compute-dtype gradients
    optimizer_state: int  # optimizer state + fp32 master (16-bit training): the K term
    frozen: int = 0       # frozen parameters, compute dtype

    @property
    def total(self) -> int:
        """Every model-state byte of this rank, wherever it lives."""
        return self.parameters + self.gradients + self.optimizer_state + self.frozen

    @property
    def device(self) -> int:
        """Bytes on the accelerator (everything unless the optimizer is offloaded)."""
        return self.total - self.host - self.nvme

    @property
    def host(self) -> int:
        return self.optimizer_state if self.offload == "cpu" else 0

    @property
    def nvme(self) -> int:
        return self.optimizer_state if self.offload == "nvme" else 0


class CommEstimate(NamedTuple):
    """What one rank sends in one optimizer step (no gradient accumulation)."""

    collectives: int  # Ψ-sized all-gathers and reduce-scatters (an all-reduce counts as 2)
    elements: int
    bytes: int


def _choice(key: str, value: str, allowed) -> str:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}")
    return value


def _positive_int(key: str, value: Any) -> int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 1 or value != int(value):
        raise ConfigError(f"{key}={value!r} is not a whole number >= 1")
    return int(value)


def _stage(stage: Any) -> StagePlan:
    if isinstance(stage, bool) or stage not in PLANS:
        raise ConfigError(f"stage={stage!r} is not one of {', '.join(map(str, PLANS))}")
    return plan_for(stage)


def compute_bytes(dtype: str) -> int:
    """c: bytes per parameter or gradient element in the compute dtype."""
    return DTYPE_BYTES[_choice("dtype", dtype, DTYPE_BYTES)]


def optimizer_bytes(optimizer: str, dtype: str) -> int:
    """K: optimizer state plus, in 16-bit training, the fp32 master, per parameter."""
    state = OPTIMIZER_STATE_BYTES[_choice("optimizer", optimizer, OPTIMIZER_STATE_BYTES)]
    return state + (MASTER_BYTES if compute_bytes(dtype) != 4 else 0)


def shard_numel(params: int, ranks: int) -> int:
    """Elements of a sharded term on one rank: ceil(Ψ / N)."""
    return -(-_positive_int("params", params) // _positive_int("ranks", ranks))


def model_state_bytes(params: int, ranks: int, stage: int, dtype: str = "fp32",
                      optimizer: str = "adamw", offload: str = "none", frozen: int = 0) -> MemoryEstimate:
    """Per-rank model-state bytes of ``params`` trainable (and ``frozen`` frozen) parameters at
    ``stage`` on ``ranks`` ranks."""
    psi, n, plan = _positive_int("params", params), _positive_int("ranks", ranks), _stage(stage)
    c, k = compute_bytes(dtype), optimizer_bytes(optimizer, dtype)
    _choice("offload", offload, OFFLOAD)
    shard = shard_numel(psi, n)
    return MemoryEstimate(
        params=psi, ranks=n, stage=plan.stage, offload=offload,
        parameters=c * (shard if plan.shard_params else psi),
        gradients=c * (shard if plan.shard_grads else psi),
        optimizer_state=k * (shard if plan.shard_optimizer else psi),
        frozen=c * (_frozen_shard(frozen, n) if plan.shard_params else _frozen(frozen)))


def _frozen(frozen: int) -> int:
    if isinstance(frozen, bool) or not isinstance(frozen, int) or frozen < 0:
        raise ConfigError(f"frozen={frozen!r} is not a whole number >= 0")
    return frozen


def _frozen_shard(frozen: int, ranks: int) -> int:
    return -(-_frozen(frozen) // ranks)


def communication_per_step(params: int, ranks: int, stage: int, dtype: str = "fp32",
                           frozen: int = 0) -> CommEstimate:
    """Elements and bytes one rank sends per step: 2Ψ(N-1)/N at stages 0-2, 3Ψ(N-1)/N at stage 3
    (plus 2Ψ_f(N-1)/N for the ``frozen`` parameters, gathered in forward and backward)."""
    n, plan = _positive_int("ranks", ranks), _stage(stage)
    collectives = len(plan.step_collectives)
    elements = collectives * (n - 1) * shard_numel(params, n)
    if plan.shard_params:  # frozen parameters are gathered with the rest, in forward and backward
        elements += 2 * (n - 1) * _frozen_shard(frozen, n)
    return CommEstimate(collectives, elements, elements * compute_bytes(dtype))


# ---- command line -------------------------------------------------------------------------

class JobModel(NamedTuple):
    """What ``--config`` contributes: the GPT's parameter count and the [zero] table's settings."""

    params: int
    dtype: str
    optimizer: str
    offload: str


def _optimizer_name(zero: Any) -> str:
    name = zero.optimizer if isinstance(zero.optimizer, str) else ""
    if name == "sgd" and zero.momentum == 0:
        return "sgd-nomomentum"
    if name not in OPTIMIZER_STATE_BYTES:
        return ""
    return name


def job_model(path: str) -> JobModel:
    """Count the parameters of the GPT a job config's [model] table describes, on the meta device."""
    import torch

    from zerompi.config import ZeroConfig
    from zerompi.models.gpt import GPT, gpt_config_from_dict

    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot read it: {e}") from e
    if not isinstance(doc.get("model"), dict):
        raise ConfigError(f"--config {path}: no [model] table (the GPT settings of jobs/train_gpt.py)")
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated, whatever the model's size
            model = GPT(gpt_config_from_dict(doc["model"]))
    except (TypeError, ValueError, RuntimeError) as e:  # ConfigError is a ValueError
        raise ConfigError(f"--config {path}: [model]: {e}") from e
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied weights once
    try:
        zero = ZeroConfig.from_dict(doc.get("zero", {}))
    except ConfigError as e:
        raise ConfigError(f"--config {path}: [zero]: {e}") from e
    return JobModel(params, zero.dtype, _optimizer_name(zero), zero.offload_optimizer)


def _settings(args: argparse.Namespace) -> tuple[int, str, str, str, str]:
    """(Ψ, where Ψ came from, dtype, optimizer, offload): flags first, then the config's [zero]."""
    if args.config is not None:
        job = job_model(args.config)
        params, source = job.params, f"the GPT of {args.config}"
        dtype, optimizer, offload = job.dtype, job.optimizer, job.offload
        if not (args.optimizer or optimizer):
            raise ConfigError(f"--config {args.config}: its optimizer is not one of "
                              f"{', '.join(OPTIMIZER_STATE_BYTES)}; pass --optimizer")
    else:
        params, source = parse_count(args.params), f"--params {args.params}"
        dtype, optimizer, offload = "fp32", "adamw", "none"  # ZeroConfig's defaults
    dtype, optimizer, offload = args.dtype or dtype, args.optimizer or optimizer, args.offload or offload
    optimizer_bytes(optimizer, dtype)  # validates both, before any output
    _choice("offload", offload, OFFLOAD)
    return params, source, dtype, optimizer, offload


def estimate_table(params: int, ranks: list[int], dtype: str, optimizer: str, offload: str,
                   frozen: int = 0) -> list[dict]:
    """One JSON-ready row per (world size, stage): bytes per term, device GB/GiB, communication."""
    rows = []
    for n in ranks:
        for stage in range(4):
            m = model_state_bytes(params, n, stage, dtype, optimizer, offload, frozen)
            comm = communication_per_step(params, n, stage, dtype, frozen)
            rows.append(dict(
                ranks=n, stage=stage, name=STAGE_NAMES[stage], parameters_bytes=m.parameters,
                gradients_bytes=m.gradients, optimizer_bytes=m.optimizer_state, frozen_bytes=m.frozen,
                device_bytes=m.device,
                host_bytes=m.host, nvme_bytes=m.nvme, device_gb=m.device / GB, device_gib=m.device / GIB,
                comm_elements=comm.elements, comm_bytes=comm.bytes))
    return rows


def _num(x: float) -> str:
    """Compact, unambiguous: 120, 52.5, 35.62, 0.1172, 1,600, 2.4e-05."""
    if x == 0:
        return "0"
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.4g}" if x >= 1e-3 else f"{x:.2e}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Right-aligned columns, except a first column of names."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    names = not all(r[0].isdigit() for r in rows)
    return ["  " + "  ".join(cell.ljust(w) if names and i == 0 else cell.rjust(w)
                             for i, (cell, w) in enumerate(zip(r, widths))) for r in [header, *rows]]


def _stage_grid(rows: list[dict], value) -> list[str]:
    """Rows: world sizes; columns: stages 0-3; cells: value(row)."""
    header = ["ranks"] + [f"stage {s} {STAGE_NAMES[s]}" for s in range(4)]
    by_n: dict[int, list[str]] = {}
    for r in rows:
        by_n.setdefault(r["ranks"], [str(r["ranks"])]).append(value(r))
    return _table(header, list(by_n.values()))


def render_text(doc: dict) -> str:
    """The human-readable report of :func:`run`."""
    rows, offload = doc["rows"], doc["offload"]
    k, c = doc["optimizer_bytes_per_param"], doc["compute_bytes"]
    master = f" + {MASTER_BYTES} fp32 master" if c != 4 else ""
    frozen = f"; Ψ_f = {doc['frozen_params']:,} frozen parameters" if doc["frozen_params"] else ""
    lines = [f"Ψ = {doc['params']:,} parameters ({doc['source']}){frozen}",
             f"{doc['dtype']} compute: c = {c} bytes; {doc['optimizer']}: K = {k} bytes/param "
             f"({k - (MASTER_BYTES if master else 0)} optimizer state{master}); offload: {offload}",
             "", "Model states per rank on the device, GB (10^9 bytes):"]
    lines += _stage_grid(rows, lambda r: _num(r["device_bytes"] / GB))
    lines += ["", "Model states per rank on the device, GiB (2^30 bytes):"]
    lines += _stage_grid(rows, lambda r: _num(r["device_bytes"] / GIB))
    if offload != "none":
        where = "host memory" if offload == "cpu" else "NVMe"
        lines += ["", f"Optimizer state + master per rank in {where}, GB:"]
        lines += _stage_grid(rows, lambda r: _num((r["host_bytes"] + r["nvme_bytes"]) / GB))
    lines += ["", "Sent per rank per optimizer step, GB (elements): "
                  "stages 0-2 2Ψ(N-1)/N, stage 3 3Ψ(N-1)/N" + (" + 2Ψ_f(N-1)/N" if frozen else "")]
    comm = [[str(r["ranks"]), f"{_num(r['comm_bytes'] / GB)} ({r['comm_elements']:,})",
             f"{_num(nxt['comm_bytes'] / GB)} ({nxt['comm_elements']:,})"]
            for r, nxt in zip(rows[0::4], rows[3::4])]
    lines += _table(["ranks", "stages 0-2", "stage 3"], comm)
    if len(rows) == 4:
        off = {"none": "off device", "cpu": "host", "nvme": "NVMe"}[offload]
        lines += ["", f"Per rank at N = {rows[0]['ranks']}, GB:"]
        lines += _table(["stage", "parameters", "gradients", "optimizer+master"] + ["frozen"] * bool(frozen)
                        + ["device", off],
                        [[f"{r['stage']} {r['name']}", _num(r["parameters_bytes"] / GB),
                          _num(r["gradients_bytes"] / GB), _num(r["optimizer_bytes"] / GB)]
                         + [_num(r["frozen_bytes"] / GB)] * bool(frozen) + [
                          _num(r["device_bytes"] / GB), _num((r["host_bytes"] + r["nvme_bytes"]) / GB)]
                         for r in rows])
    return "\n".join(lines)


def _link(args: argparse.Namespace) -> tuple[float, float]:
    """(bits per second, latency seconds) of ``--link-gbps`` and ``--latency-us``."""
    for flag, value in (("--link-gbps", args.link_gbps), ("--latency-us", args.latency_us)):
        if not (math.isfinite(value) and value >= 0) or (flag == "--link-gbps" and value == 0):
            raise ConfigError(f"{flag} {value!r} is not a finite number {'> 0' if flag == '--link-gbps' else '>= 0'}")
    return args.link_gbps * 1e9, args.latency_us * 1e-6


def run(args: argparse.Namespace) -> int:
    """``zerompi estimate``: print the table (or JSON) for the parsed arguments."""
    params, source, dtype, optimizer, offload = _settings(args)
    ranks = parse_ranks(args.ranks)
    frozen = parse_count(args.frozen_params, "--frozen-params", minimum=0)
    quant = commtime.check(args.quantize_weights, args.quantize_grads, args.quant_block)
    link = _link(args)
    doc = dict(params=params, source=source, frozen_params=frozen, dtype=dtype, compute_bytes=compute_bytes(dtype),
               optimizer=optimizer, optimizer_bytes_per_param=optimizer_bytes(optimizer, dtype),
               offload=offload, ranks=ranks, rows=estimate_table(params, ranks, dtype, optimizer, offload, frozen))
    comm = commtime.comm_rows(lambda n: shard_numel(params, n), ranks, compute_bytes(dtype), quant, link,
                              frozen_of=lambda n: _frozen_shard(frozen, n))
    doc["communication"] = dict(quantize_weights=quant.weights, quantize_grads=quant.grads, quant_block=quant.block,
                                link_gbps=args.link_gbps, latency_us=args.latency_us, rows=comm)
    text = render_text(doc) + "\n" + "\n".join(commtime.render(comm, quant, link, _num))
    print(json.dumps(doc, indent=1) if args.json else text)
    return 0


def register(subparsers) -> None:
    """Add ``zerompi estimate`` to the ``zerompi`` command's subparsers."""
    p = subparsers.add_parser(
        "estimate", help="model-state memory and communication per rank for ZeRO stages 0-3",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  zerompi estimate --params 7.5B --ranks 1-1024*4 --dtype fp16 --optimizer adam\n"
               "  zerompi estimate --config jobs/configs/default.toml --ranks 2 --json\n"
               "  zerompi estimate --params 20M --frozen-params 7B --ranks 8 --dtype bf16   # LoRA on a 7B base\n"
               "  zerompi estimate --params 7.5B --ranks 16-1024*4 --dtype bf16 --quantize-weights int8 "
               "--quantize-grads int4 --link-gbps 25")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", metavar="PSI",
                        help="parameter count: 7500000000, 7.5e9, 7.5B, 350M, 125k")
    source.add_argument("--config", metavar="TOML",
                        help="a job config (jobs/configs/*.toml): count the parameters of its [model] GPT "
                             "and take dtype, optimizer and offload from its [zero] table")
    p.add_argument("--ranks", required=True, metavar="N",
                   help="data-parallel world size(s): 64, 1,4,16,64, 1-8, 8-64:8 (step), 1-1024*4 (x4)")
    p.add_argument("--dtype", help="compute dtype: " + ", ".join(DTYPE_BYTES)
                   + " (default: the config's, else fp32)")
    p.add_argument("--optimizer", help="optimizer: " + ", ".join(OPTIMIZER_STATE_BYTES)
                   + " (sgd: with momentum; default: the config's, else adamw)")
    p.add_argument("--offload", help="where optimizer state + master live: " + ", ".join(OFFLOAD)
                   + " (default: the config's, else none)")
    p.add_argument("--frozen-params", default="0", metavar="PSI_F",
                   help="frozen parameters besides PSI (a fine-tuned base): c bytes each, replicated at "
                        "stages 0-2, sharded and gathered at stage 3 (default 0)")
    p.add_argument("--quantize-weights", default="none", help="parameter all-gathers: none, int8 (qwZ)")
    p.add_argument("--quantize-grads", default="none", help="gradient reduce-scatters: none, int8, int4 (qgZ)")
    p.add_argument("--quant-block", type=int, default=256, help="values per fp32 scale (default 256)")
    p.add_argument("--link-gbps", type=float, default=100.0,
                   help="link bandwidth for the α-β time projection, Gb/s (default 100)")
    p.add_argument("--latency-us", type=float, default=5.0, help="link latency, µs (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.set_defaults(func=run)
