"""Stage 3's frozen parameters on this world size: sharded, gathered, offloaded, checkpointed.

The model is the tiny GPT with its embeddings (tied to the LM head) and MLP weights frozen, as in
a fine-tuning job: every gather unit holds frozen and trainable parameters. Phases:

* ``train``: parity with single-process PyTorch (fp32, accumulation 2, flat and hpZ) with the
  bytes and memory counters; the frozen storage gathered inside backward (held.py); offload
  none/cpu/nvme bitwise alike (fp32, bf16); requires_grad changed after initialize; a meta-device
  build; frozen sets that differ between ranks.
* ``save``: train, then save with and without the frozen base (and from stage 1) into ``--dir``.
* ``load`` (another world size): load those into engines of other stages and bases.

Rank 0 writes one JSON object.
"""
import argparse
import os

import numpy as np
import torch
from mpi4py import MPI

import zerompi
from common import (compare, engine_train, gpt_loss, initial_params, local_part, references, tiny_gpt,
                    token_batches, write_json, zero_train)
from held import held_in_backward
from zerompi.checkpoint import load_full_state_dict
from zerompi.errors import CheckpointError, ModelMismatchError, UsageError

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--phase", choices=("train", "save", "load"), default="train")
p.add_argument("--dir")
args = p.parse_args()
COMM = MPI.COMM_WORLD
world, rank = COMM.Get_size(), COMM.Get_rank()
ADAMW = dict(optimizer="adamw", lr=1e-2, weight_decay=0.1, bucket_mb=0.004, seed=0)


def freeze(model, frozen=("wte", "mlp")):
    for n, q in model.named_parameters():
        q.requires_grad_(not any(part in n for part in frozen))
    return model


def frozen_gpt(seed=1, **overrides):
    return freeze(tiny_gpt(seed, **overrides))


def sizes(engine) -> dict:
    return dict(frozen_padded=sum(b.layout.padded_numel for b in engine.sharded.all_buckets if not b.trains),
                trainable_padded=sum(b.layout.padded_numel for b in engine.sharded.buckets),
                frozen_numel=sum(b.layout.numel for b in engine.sharded.all_buckets if not b.trains),
                model_state_bytes=engine.stats.model_state_bytes, bytes_sent=dict(engine.stats.bytes_sent))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def parity(**extra) -> dict:
    cfg = zerompi.ZeroConfig(stage=3, grad_accum_steps=2, **ADAMW, **extra)
    batches = token_batches(7, world, 2, 2)
    model = frozen_gpt()
    init = initial_params(model)
    ours, engine = zero_train(model, cfg, batches)
    row = dict(sizes(engine), steps=2, accum=2, units=len(engine.sharded.units))
    engine.close()
    ref, alts = references(MPI.COMM_WORLD, frozen_gpt, cfg, batches)
    if rank == 0:
        row.update(compare(ours, ref, alts, init))
    return row


def offload(dtype: str, swap: str) -> dict:
    runs = {}
    for mode in ("none", "cpu", "nvme"):
        cfg = zerompi.ZeroConfig(stage=3, dtype=dtype, offload_optimizer=mode, offload_params=mode,
                                 nvme_path=swap, **ADAMW)
        run, engine = zero_train(frozen_gpt(), cfg, token_batches(3, world, 2, 1))
        runs[mode] = (run.params, run.losses, engine.stats.swapped_bytes)
        engine.close()
    return {m: same(runs["none"][0], runs[m][0]) and runs["none"][1] == runs[m][1] for m in runs} | \
        {"nvme_swapped": runs["nvme"][2]}


def error_of(fn) -> str:
    try:
        fn()
    except (UsageError, ModelMismatchError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def requires_grad_changed(flip: str) -> list:
    engine = zerompi.initialize(frozen_gpt(), zerompi.ZeroConfig(stage=3, **ADAMW))
    engine.module.get_parameter(flip).requires_grad_(not engine.module.get_parameter(flip).requires_grad)
    batch = local_part(token_batches(1, world, 1, 1)[0][0], rank)
    message = error_of(lambda: engine.backward(gpt_loss(engine, batch)))
    engine.close()
    return COMM.allgather(message)


def meta(stage: int) -> dict:
    """Built on the meta device; param_init fills each module's own parameters with a constant."""
    with torch.device("meta"):
        model = frozen_gpt()

    def init(module):
        for n, q in module.named_parameters(recurse=False):
            with torch.no_grad():
                q.fill_(0.01 * len(n))
    cfg = zerompi.ZeroConfig(stage=stage, **ADAMW)
    out = {}
    message = error_of(lambda: out.setdefault("engine", zerompi.initialize(model, cfg, param_init=init)))
    if "engine" not in out:
        return dict(errors=COMM.allgather(message))
    engine = out["engine"]
    full = engine.full_state_dict()
    frozen = [n for n, q in engine.module.named_parameters() if not q.requires_grad]
    engine.close()
    return dict(errors=COMM.allgather(message), frozen=len(frozen),
                frozen_values=all(torch.equal(full[n], torch.full_like(full[n], 0.01 * len(n.rpartition(".")[2])))
                                  for n in frozen))


def mismatched() -> list:
    model = frozen_gpt() if rank == 0 else freeze(tiny_gpt(1), ("wte", "mlp", "ln_f"))
    return COMM.allgather(error_of(lambda: zerompi.initialize(model, zerompi.ZeroConfig(stage=3, **ADAMW))))


def held(prefetch: int) -> list:
    """Frozen storage gathered inside backward, every rank's (held.py); four blocks, so that later
    blocks kept gathered would show while the first ones compute."""
    engine = zerompi.initialize(frozen_gpt(n_layer=4), zerompi.ZeroConfig(stage=3, prefetch_units=prefetch, **ADAMW))
    batches = [local_part(step[0], rank) for step in token_batches(11, world, 2, 1)]
    row = held_in_backward(engine, batches, gpt_loss, prefetch)
    engine.close()
    return COMM.allgather(row)


def train_phase(swap: str) -> dict:
    return dict(parity=parity(), hpz=parity(hierarchy="hpz", ranks_per_node=1), held={p: held(p) for p in (0, 1)},
                offload={d: offload(d, swap) for d in ("fp32", "bf16")},
                changed={n: requires_grad_changed(n) for n in ("transformer.h.0.mlp.c_fc.weight",
                                                               "transformer.h.1.attn.c_attn.weight")},
                meta={s: meta(s) for s in (1, 3)}, mismatched=mismatched())


def trained(stage: int, **extra) -> zerompi.Engine:
    engine = zerompi.initialize(frozen_gpt(), zerompi.ZeroConfig(stage=stage, **ADAMW, **extra))
    engine_train(engine, token_batches(5, world, 2, 1))
    return engine


def save_phase(root: str) -> dict:
    engine = trained(3)
    engine.save_checkpoint(root, tag="full")
    engine.save_checkpoint(root, tag="adapters", include_frozen=False)
    full = engine.full_state_dict()
    engine.close()
    engine = trained(1)
    engine.save_checkpoint(root, tag="stage1")
    engine.close()
    # In the background, with the frozen shards (and everything else) in the swap file: the file holds
    # the state of the call while two more steps run, and frozen shards never alias a master's region.
    engine = trained(3, offload_params="nvme", offload_optimizer="nvme", nvme_path=swap)
    engine.save_checkpoint(root, tag="async-nvme", async_save=True)
    engine_train(engine, token_batches(2, world, 2, 1))
    engine.wait_checkpoint()
    engine.close()
    sizes_ = {tag: sum(os.path.getsize(os.path.join(root, tag, f)) for f in os.listdir(os.path.join(root, tag)))
              for tag in ("full", "adapters")} if rank == 0 else {}
    if rank == 0:  # the test's own record of the saved values, next to the checkpoints
        np.savez(os.path.join(root, "expected.npz"), **{n: t.numpy() for n, t in full.items()})
    return dict(bytes=sizes_)


def load_into(root: str, tag: str, stage: int, model) -> dict:
    engine = zerompi.initialize(model, zerompi.ZeroConfig(stage=stage, **ADAMW))
    before = engine.full_state_dict()
    message = error_of(lambda: engine.load_checkpoint(root, tag=tag))
    after = engine.full_state_dict()
    engine.close()
    return dict(error=COMM.allgather(message), after=after, unchanged=same(before, after), before=before)


def quantized_load(root: str) -> bool:
    """Quantized weight gathers read packed codes: a load must re-pack the frozen shards it wrote. An
    engine that had another base before loading computes what one built with the saved base does."""
    batch = local_part(token_batches(2, world, 1, 1)[0][0], rank)
    losses = []
    for seed in (7, 1):
        engine = zerompi.initialize(frozen_gpt(seed=seed), zerompi.ZeroConfig(stage=3, quantize_weights="int8",
                                                                             **ADAMW))
        engine.load_checkpoint(root, tag="full")
        with torch.no_grad():
            losses.append(float(gpt_loss(engine, batch)))
        engine.close()
    return all(COMM.allgather(losses[0] == losses[1]))


def load_phase(root: str) -> dict:
    with np.load(os.path.join(root, "expected.npz"), allow_pickle=False) as f:
        expected = {n: torch.from_numpy(f[n]) for n in f.files}
    trainable = {n for n, q in frozen_gpt().named_parameters() if q.requires_grad}
    out = {}
    for tag, stage in (("full", 3), ("full", 1), ("stage1", 3), ("async-nvme", 3)):
        r = load_into(root, tag, stage, frozen_gpt(seed=7))  # another init: every value must come from the file
        out[f"{tag}->stage{stage}"] = dict(error=r["error"], equal=same(r["after"], expected) if tag in ("full", "async-nvme")
                                           else not r["unchanged"])
    r = load_into(root, "adapters", 3, frozen_gpt(seed=1))  # the same base, built by the job
    out["adapters"] = dict(error=r["error"], equal=same(r["after"], expected))
    r = load_into(root, "adapters", 3, frozen_gpt(seed=7))  # same shapes, another base: its own values stay
    out["adapters-other-values"] = dict(
        error=r["error"], trainable=all(torch.equal(r["after"][n], expected[n]) for n in trainable),
        frozen_kept=all(torch.equal(r["after"][n], r["before"][n]) for n in r["after"] if n not in trainable))
    r = load_into(root, "adapters", 3, frozen_gpt(seed=1, vocab_size=40))  # another base shape
    out["adapters-other-base"] = dict(error=r["error"], unchanged=r["unchanged"])
    out["quantized-repacked"] = quantized_load(root)
    if rank == 0:
        out["consolidated"] = {tag: sorted(load_full_state_dict(root, tag)) for tag in ("full", "adapters")}
        out["trainable"] = sorted(trainable)
        out["names"] = sorted(expected)
    return out


swap = os.path.join(args.dir or os.environ.get("TMPDIR", "/tmp"), f"swap-{os.getpid()}")
os.makedirs(swap, exist_ok=True)
result = {"train": lambda: train_phase(swap), "save": lambda: save_phase(args.dir),
          "load": lambda: load_phase(args.dir)}[args.phase]()
if rank == 0:
    write_json(args.out, result)
