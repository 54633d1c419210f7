"""One LoRA trial: a Llama-style frozen base (bf16) with PEFT LoRA adapters trains a few steps on N ranks.

    mpiexec -n 2 python -m mpi4py benchmarks/workers/lora_worker.py --mode stage3+nvme --n-layer 48 \
        --nvme DIR --out OUT.json [--steps 2] [--warmup 0]

The model is ``transformers.LlamaForCausalLM`` (TinyLlama's widths by default: hidden 2048,
intermediate 5632, 32 heads, 4 key/value heads, vocabulary 32000; the depth is the trial's) under
``peft.get_peft_model`` with LoRA r=8 on all seven projections, as ``jobs/finetune_lora.py`` builds it.
Each step is one micro-batch of ``--seq`` random tokens per rank, bf16 compute, AdamW on the adapters.

- zerompi modes (``stage0``, ``stage3``, ``stage3+cpu``, ``stage3+nvme``): the PEFT model is built on
  the meta device and ``zerompi.initialize(..., param_init=...)`` materialises it one unit at a time
  (``jobs/finetune_lora.py``'s ``build`` and ``param_init``). At stage 0 frozen parameters are
  replicated and must be real: every rank materialises its own bf16 copy of the base first, one
  module at a time, as a user loading ``from_pretrained(dtype=torch.bfloat16)`` would.
- DeepSpeed modes (``deepspeed-zero3``, ``deepspeed-zero3-lean``, ``deepspeed-zero3+cpu``,
  ``deepspeed-zero3+nvme``; the peers venv): DeepSpeed 0.19.8
  ZeRO-3 with ``DS_ACCELERATOR=cpu`` over gloo; the base is built under ``deepspeed.zero.Init`` (each
  module partitioned as soon as it is constructed, so no rank holds the whole base), PEFT is applied
  after it and ``deepspeed.initialize`` partitions the adapters; bf16, a plain ``torch.optim.AdamW``.
  ``-lean`` sets DeepSpeed's memory knobs to gather one layer at a time (DS_LEAN below); ``+cpu`` and
  ``+nvme`` add ``offload_param`` and ``offload_optimizer`` to the CPU or to ``--nvme`` (ds_offload below).

Every rank starts each step at a barrier; a step's time is the slowest rank's. Rank 0 writes JSON:
parameters, seconds per phase, per-step times and losses, peak RSS (and zerompi's model-state bytes)
per rank. bench_capacity.py runs it inside a memory-capped cgroup, bench_lora_steps.py for step time.
With ``--trace`` it also records rank 0's collectives of the timed steps (peers/calltrace.py: zerompi's
``ProcessGroup`` calls, DeepSpeed's ``torch.distributed`` calls), which ``bench_transport.py --lora`` replays.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import zlib
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "jobs"), str(ROOT / "benchmarks" / "peers")]  # a checkout, uninstalled
import calltrace  # noqa: E402  (records nothing unless --trace starts it)
from procstat import peak_rss  # noqa: E402

ZEROMPI_MODES = {
    "stage0": dict(stage=0),
    "stage3": dict(stage=3),
    "stage3-lean": dict(stage=3, return_freed_memory=True),  # freed blocks go back to the OS: slower, leaner
    "stage3+cpu": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    "stage3+nvme": dict(stage=3, offload_optimizer="nvme", offload_params="nvme"),
}
# DeepSpeed's knobs for gathered parameters, per mode. Its defaults (max live parameters and reuse
# distance 1e9 elements, prefetch bucket 5e7) keep gathered parameters from forward to backward;
# "lean" releases each layer after use and prefetches none, DeepSpeed's advice for running out of memory.
DS_LEAN = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
# Offload rows take the lean knobs too (DeepSpeed's best here without offload) and move the partitioned
# base and the optimizer state to the CPU or to NVMe (ZeRO-Infinity: its async I/O op, built against libaio).
DS_MODES = {"deepspeed-zero3": {}, "deepspeed-zero3-lean": DS_LEAN,
            "deepspeed-zero3+cpu": dict(DS_LEAN, offload="cpu"), "deepspeed-zero3+nvme": dict(DS_LEAN, offload="nvme")}
MODES = (*ZEROMPI_MODES, *DS_MODES)
LR = 1e-4
WIDE_BLOCK = 1 << 22  # elements of a bf16 weight widened to fp32 at a time (WideMatmul)


def model_doc(args) -> dict:
    """The LlamaConfig and LoraConfig fields, in jobs/configs/lora.toml's layout."""
    return {"base": dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.n_layer, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False),
            "lora": dict(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"])}


def loss_of(model: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _wide_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 16-bit ``a`` [..., k] and ``b`` [k, n], computed in fp32 a block of ``b``'s columns at
    a time (at most WIDE_BLOCK elements widened at once), the result rounded back to ``a``'s dtype."""
    cols, af = max(1, WIDE_BLOCK // b.shape[0]), a.float()
    return torch.cat([af @ b[:, j:j + cols].float() for j in range(0, b.shape[1], cols)], dim=-1).to(a.dtype)


class _WideLinear(torch.autograd.Function):
    """``F.linear`` through :func:`_wide_mm`. It saves the weight parameter itself, not a view of it, as
    DeepSpeed's ZeRO-3 linear (``memory_efficient_linear``) does: an engine that frees a gathered
    weight after forward (zerompi empties its storage, DeepSpeed swaps ``.data``) frees it for real,
    and gathers it again for backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w, b)
        y = _wide_mm(x, w.t())
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        flat = g.reshape(-1, g.shape[-1]).float()
        gx = _wide_mm(g, w) if ctx.needs_input_grad[0] else None
        gw = (flat.t() @ x.reshape(-1, x.shape[-1]).float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        gb = flat.sum(0).to(b.dtype) if b is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class WideMatmul(torch.overrides.TorchFunctionMode):
    """Every bf16 ``F.linear`` through :class:`_WideLinear`, in every row alike (the mode sees forward;
    the autograd engine runs backward without modes, which is why the backward is _WideLinear's own).

    On this CPU (AVX2, no AVX-512) torch has no fast bf16 GEMM: its fallback loops ran a
    2048 x 5632 layer's input gradient at 0.03-0.06 GFLOP/s (forward 1.2-2 GFLOP/s), so a step of a
    2-layer base took 6 minutes. Widening one block of the weight at a time runs the same products at
    2-6 GFLOP/s for 16 MiB of extra memory; what is stored, gathered and communicated stays bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args[0].dtype == torch.bfloat16:
            return _WideLinear.apply(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
        return func(*args, **kwargs)


class Pool:
    """The base's values: slices of one block of N(0, 0.02) draws, from the same seed on every rank and in
    every framework. A weight's element i is ``block[(crc32(name) + i) % len(block)]``, so each
    tensor is filled at copy speed (drawing 10^10 normal numbers would take hours on this machine) and
    a DeepSpeed partition, filled from its own offset, holds what the same elements hold in zerompi."""

    SIZE = 1 << 22

    def __init__(self, seed: int):
        block = torch.empty(self.SIZE).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
        self.twice = torch.cat([block, block])

    def fill(self, name: str, flat: torch.Tensor, start: int = 0) -> None:
        """``flat`` (1-D) := the values of ``name``'s elements ``start``, ``start + 1``, ..."""
        if name.endswith("norm.weight"):  # RMSNorm gains start at one, as in Llama
            flat.fill_(1.0)
            return
        for i in range(0, flat.numel(), self.SIZE):
            o = (zlib.crc32(name.encode()) + start + i) % self.SIZE
            n = min(self.SIZE, flat.numel() - i)
            flat[i:i + n].copy_(self.twice[o:o + n])


def param_init(model: torch.nn.Module, pool: Pool) -> Callable[[torch.nn.Module], None]:
    """``initialize``'s ``param_init``: LoRA A Kaiming-uniform and B zeros, as peft does (training starts from
    the base itself); base modules from ``pool``."""
    from finetune_lora import base_name, init_adapter
    names = {id(m): n for n, m in model.named_modules()}

    def init(module: torch.nn.Module) -> None:
        name = names[id(module)]
        if not init_adapter(name, module):
            for pname, p in module.named_parameters(recurse=False):
                pool.fill(base_name(name, pname), p.data.view(-1))
    return init


def materialize_frozen(model: torch.nn.Module, init: Callable[[torch.nn.Module], None]) -> None:
    """Stage 0 replicates frozen parameters, so they must be real: each module's own frozen meta
    parameters become bf16 tensors and ``init`` fills them (one module's worth of memory at a time)."""
    for module in model.modules():
        meta = [(n, p) for n, p in module.named_parameters(recurse=False) if p.is_meta and not p.requires_grad]
        for name, p in meta:
            setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=torch.bfloat16), requires_grad=False))
        if meta:
            init(module)


def zerompi_trainer(args, comm) -> tuple[Callable, dict]:
    import zerompi
    from finetune_lora import build
    model, _ = build(model_doc(args))
    init = param_init(model, Pool(args.seed))
    cfg = zerompi.ZeroConfig(optimizer="adamw", lr=LR, weight_decay=0.0, dtype="bf16", cpu_threads=1,
                             nvme_path=args.nvme, **ZEROMPI_MODES[args.mode])
    if cfg.stage == 0:
        materialize_frozen(model, init)
    frozen, trainable = count(model, trainable=False), count(model, trainable=True)
    if args.trace:
        calltrace.install_zerompi()
    engine = zerompi.initialize(model, cfg, param_init=init, comm=comm)

    def step(x, y) -> float:
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    def report() -> dict:
        s = engine.stats
        return {"model_state_bytes": s.model_state_bytes, "swapped_bytes": s.swapped_bytes}
    info = {"framework": f"zerompi {zerompi.__version__}", "units": len(engine.sharded.units),
            "bytes_sent": lambda: dict(engine.stats.bytes_sent),
            "params": frozen, "lora_params": trainable, "report": report, "close": engine.close}
    return step, info


def count(model: torch.nn.Module, trainable: bool) -> int:
    return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()
               if p.requires_grad == trainable)


def ds_offload(device: str, nvme: str | None, numel: int) -> dict:
    """``offload_param`` / ``offload_optimizer`` (and ``aio``) for ``device``: unpinned buffers (pinning on the
    CPU accelerator only locks pages); for NVMe, parameter swap buffers just large enough for the largest
    parameter (``numel`` elements), DeepSpeed's fewest, so its buffers take as little of the cap as it allows."""
    if device == "cpu":
        return {"offload_param": {"device": "cpu", "pin_memory": False},
                "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    return {"offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": False, "buffer_count": 5,
                              "buffer_size": numel, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": False, "buffer_count": 4}}


def ds_config(args) -> dict:
    zero = dict(DS_MODES[args.mode])
    offload = zero.pop("offload", None)
    if offload:  # largest parameter: the embedding and the head, vocab x hidden
        zero.update(ds_offload(offload, args.nvme, args.vocab * args.hidden))
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            # every row's F.linear is _WideLinear (WideMatmul), which saves the weight parameter as DeepSpeed's
            # own memory-efficient linear does; DeepSpeed's would replace F.linear and hide it from the mode
            "zero_optimization": {"stage": 3, "memory_efficient_linear": args.matmul == "native",
                                  **zero},
            "zero_allow_untested_optimizer": True,  # a plain torch.optim.AdamW, as zerompi's rows use
            # with offload_optimizer DeepSpeed refuses a client optimizer unless told not to force its own
            "zero_force_ds_cpu_optimizer": False,
            "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def deepspeed_trainer(args, comm) -> tuple[Callable, dict]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed compiles a small op on its first start; torch's default build folder is shared by every
    # venv on the machine, and one venv's build makes the next venv's start rebuild it (g++ inside the
    # trial's memory cap). This venv gets its own.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
    import logging

    import commcount
    import deepspeed
    import rowlib
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers.initialization import no_init_weights
    commcount.install()  # before DeepSpeed's comm layer takes references to the collectives
    rowlib.init_torch_distributed(comm)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    doc, config = model_doc(args), ds_config(args)
    # As from_pretrained does under ZeRO-3: no initialisation while each module is built and partitioned;
    # then each rank fills its own partitions (with the values zerompi's rows give the same elements).
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**doc["base"]))
    pool = Pool(args.seed)
    for name, p in base.named_parameters():
        pool.fill(name, p.ds_tensor.data.view(-1), start=comm.rank * p.ds_tensor.numel())
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **doc["lora"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if args.matmul == "wide" and torch.nn.functional.linear is not torch._C._nn.linear:
        raise RuntimeError("DeepSpeed replaced torch.nn.functional.linear although memory_efficient_linear is "
                           "off: the rows would not share the linear kernel")

    def step(x, y) -> float:
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())
    info = {"framework": f"deepspeed {deepspeed.__version__}", "ds_config": config,
            "params": count(model, trainable=False), "lora_params": count(model, trainable=True),
            "bytes_sent": commcount.bytes_sent, "report": dict, "close": lambda: None}
    return step, info


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--seq", type=int, default=32, help="tokens per rank per step (one sequence)")
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--matmul", choices=("wide", "native"), default="wide",
                   help="bf16 F.linear widened to fp32 block by block (WideMatmul), or torch's own bf16 kernels")
    p.add_argument("--nvme", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--trace", action="store_true",
                   help="record the collectives of the timed steps (peers/calltrace.py; bench_transport.py --lora)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    comm = MPI.COMM_WORLD
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    step, info = (zerompi_trainer if args.mode in ZEROMPI_MODES else deepspeed_trainer)(args, comm)
    torch.set_num_threads(1)  # a framework may have changed it; every row gets one thread per rank
    comm.Barrier()
    setup_s = time.perf_counter() - t0
    times, losses, sent = [], [], {}
    matmul = WideMatmul if args.matmul == "wide" else contextlib.nullcontext
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            sent = info["bytes_sent"]()
            if args.trace:
                calltrace.start()
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + i * 1009 + comm.rank)
        data = torch.randint(0, args.vocab, (1, args.seq + 1), generator=g)
        comm.Barrier()  # every rank starts the step together: the slowest rank's time is the step's
        t = time.perf_counter()
        with matmul():
            loss = step(data[:, :-1], data[:, 1:])
        times.append(time.perf_counter() - t)
        losses.append(loss)
    calls = calltrace.stop()
    per_step = {k: (v - sent.get(k, 0)) / args.steps for k, v in info["bytes_sent"]().items() if v - sent.get(k, 0)}
    gc.collect()
    mine = {"peak_rss": peak_rss(), "rss_steady": rss_now(), "bytes_sent_per_step": per_step,
            "times": times[args.warmup:], "losses": losses, **info["report"]()}
    ranks = comm.gather(mine, root=0)
    info["close"]()
    if comm.rank == 0:
        loss_mean = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(losses))]
        Path(args.out).write_text(json.dumps({
            "mode": args.mode, "n_layer": args.n_layer, "params": info["params"], "lora_params": info["lora_params"],
            "framework": info["framework"], "units": info.get("units"), "ds_config": info.get("ds_config"),
            "dtype": "bf16", "matmul": args.matmul, "seq": args.seq, "world_size": comm.size, "initialize_s": setup_s,
            "step_s": [max(r["times"][i] for r in ranks) for i in range(args.steps)], "warmup": args.warmup,
            "losses": loss_mean, "finite": all(math.isfinite(x) for x in loss_mean),
            "ranks": [{k: v for k, v in r.items() if k not in ("times", "losses")} for r in ranks],
            **({"trace": calls} if args.trace else {})}))


if __name__ == "__main__":
    main()
