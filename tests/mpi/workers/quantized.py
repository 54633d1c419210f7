"""Quantized collectives on this world size: the collectives alone, then through the engine.

Rows (rank 0 writes them; tests/mpi/test_quantized.py judges them), each named by ``case``:

* ``rs/...``, ``ag/...``: comm/compressed.py's reduce-scatter and all-gather of random and
  special blocks (zero, constant, huge, subnormal) against the exact result in float64, with the
  bound derived from the block scales every rank used, the bytes counted, async == blocking,
  error feedback's identity, and NaN blocks;
* ``train/...``: the tiny GPT through the engine, quantized, with the per-bucket shard sizes the
  byte formulas need, the gathered parameters against the exact ones (bound from the scales),
  replicas, digests of offload/overlap variants, a checkpoint resume, non-finite gradients.
"""
import argparse
import logging
import tempfile

import torch
from mpi4py import MPI

import zerompi
from common import digest, engine_train, initial_params, rel_to_update, tiny_gpt, token_batches, write_json
from zerompi.comm.codec import BlockCodec
from zerompi.comm.compressed import CompressedGroup
from zerompi.comm.mpi import MPIGroup
from zerompi.errors import ZeroMPIError

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--rows", choices=("all", "core", "hpz"), default="all",
               help="all: every case; core: the collectives and the main engine cases; hpz: the collectives and "
                    "the hpz/hsdp cases (world sizes with 2 ranks per node)")
args = p.parse_args()
torch.set_num_threads(1)
world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
rows = []
CODECS = {"int8": BlockCodec(8, 256), "int4": BlockCodec(4, 256), "int8-b6": BlockCodec(8, 6)}


def gather(obj):
    return MPI.COMM_WORLD.allgather(obj)


# ---- the collectives alone ---------------------------------------------------------------

def data(kind: str, r: int, n: int) -> torch.Tensor:
    """Rank r's full buffer of ``n`` values: random at several scales, or special blocks."""
    g = torch.Generator().manual_seed(100 * r + n)
    x = torch.randn(n, generator=g) * torch.logspace(-8, 8, n).roll(r * 97)
    if kind == "special":
        x[:300] = 0.0                                   # all-zero blocks
        x[300:700] = 1.25 * (r + 1)                     # constant
        x[700:900] = torch.tensor([3.0e38, -1.0e38]).repeat(100) / (world * (r + 1))  # huge: sums stay finite
        x[900:1300] = torch.tensor([1e-45, 7e-45, 3e-42, -2.5e-39]).repeat(100)  # subnormal
    return x


def rs_row(name: str, codec: BlockCodec, group, kind: str, chunk: int) -> dict:
    n = chunk * world
    full = [data(kind, r, n) for r in range(world)]
    comm = CompressedGroup(group, codec)
    before = dict(group.bytes_sent)
    got = comm.reduce_scatter(full[rank]).wait()
    sent = {k: v - before.get(k, 0) for k, v in group.bytes_sent.items() if v != before.get(k, 0)}
    again = comm.reduce_scatter(full[rank], async_op=True).wait()
    mine = slice(rank * chunk, (rank + 1) * chunk)
    exact = sum(x[mine].double() for x in full)
    # what every rank sent me, decoded, and its bound: re-encoded here from its data (deterministic)
    bounds = sum(codec.bound(codec.encode(x[mine], chunk), chunk).reshape(-1).double() for x in full)
    decoded_abs = sum(codec.decode(codec.encode(x[mine], chunk), chunk).reshape(-1).double().abs() for x in full)
    slack = bounds + world * 2.0 ** -24 * decoded_abs  # the fp32 sum over ranks
    ratio = ((got.double() - exact).abs() / slack.clamp_min(1e-300))
    return dict(case=name, world=world, chunk=chunk, bits=codec.bits, block=codec.block, sent=sent,
                max_ratio=max(gather(float(ratio.max()))), finite=all(gather(bool(torch.isfinite(got).all()))),
                async_equal=all(gather(torch.equal(got, again))),
                exact_ratio_max=max(gather(float(((got.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max()))))


def ag_row(name: str, codec: BlockCodec, group, kind: str, chunk: int, dtype) -> dict:
    shards = [data(kind, r, chunk).to(dtype) for r in range(world)]
    packed = codec.encode(shards[rank], chunk)
    out = torch.empty(chunk * world, dtype=dtype)
    before = dict(group.bytes_sent)
    CompressedGroup(group, codec).all_gather(packed, out, chunk=chunk).wait()
    sent = {k: v - before.get(k, 0) for k, v in group.bytes_sent.items() if v != before.get(k, 0)}
    out2 = torch.empty_like(out)
    CompressedGroup(group, codec).all_gather(packed, out2, chunk=chunk, async_op=True).wait()
    exact = torch.cat(shards).double()
    bound = torch.cat([codec.bound(codec.encode(s, chunk), chunk).reshape(-1) for s in shards]).double()
    if dtype != torch.float32:  # the decoded fp32 value rounded to the output dtype: half an ulp more
        bound = bound + out.double().abs() * torch.finfo(dtype).eps / 2
    ratio = (out.double() - exact).abs() / bound.clamp_min(1e-300)
    same = len({bytes(b) for b in gather(out.view(torch.uint8).numpy().tobytes())}) == 1
    return dict(case=name, world=world, chunk=chunk, bits=codec.bits, block=codec.block, sent=sent,
                max_ratio=max(gather(float(ratio.max()))), replicas_equal=same,
                async_equal=all(gather(torch.equal(out, out2))), finite=all(gather(bool(torch.isfinite(out).all()))))


def feedback_row(codec: BlockCodec, group) -> dict:
    """Error feedback: what is summed is each rank's gradient plus its old residual minus its new one."""
    chunk = 700
    n = chunk * world
    x = data("random", rank, n)
    old = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 1e-3
    residual = old.clone()
    got = CompressedGroup(group, codec).reduce_scatter(x, residual=residual).wait()
    sent_values = [t.double() for t in gather(x + old - residual)]
    mine = slice(rank * chunk, (rank + 1) * chunk)
    exact = sum(s[mine] for s in sent_values)
    err = float(((got.double() - exact).abs() / (world * 2.0 ** -23 * sum(s[mine].abs() for s in sent_values)
                                                  ).clamp_min(1e-30)).max())
    return dict(case="rs/feedback", world=world, identity_ratio=max(gather(err)),
                residual_nonzero=all(gather(bool((residual != 0).any()))))


def nan_row(codec: BlockCodec, group) -> dict:
    chunk = 600
    x = data("random", rank, chunk * world)
    if rank == world - 1:
        x[chunk * 0 + 300] = float("nan")  # lands in rank 0's chunk, block 1 (values 256..511)
        x[chunk * 0 + 10] = float("inf")   # block 0
    got = CompressedGroup(group, codec).reduce_scatter(x).wait()
    return dict(case="rs/nan", world=world, chunk=chunk, block=codec.block,
                nonfinite=gather(torch.nonzero(~torch.isfinite(got)).reshape(-1).tolist()))


group = MPIGroup(MPI.COMM_WORLD)
for cname, codec in CODECS.items():
    for kind in ("random", "special"):
        for chunk in (1500, 1301):
            rows.append(rs_row(f"rs/{cname}/{kind}/{chunk}", codec, group, kind, chunk))
    if cname == "int8":
        for dtype in (torch.float32, torch.bfloat16):
            for kind in ("random", "special"):
                rows.append(ag_row(f"ag/{kind}/{str(dtype)[6:]}", codec, group, kind, 1301, dtype))
rows.append(feedback_row(CODECS["int4"], group))
rows.append(nan_row(CODECS["int8"], group))


# ---- through the engine ----------------------------------------------------------------

STEPS = 3


def config(**kw):
    base = dict(stage=3, bucket_mb=0.004, lr=1e-2, weight_decay=0.1, cpu_threads=1, abort_on_exception=False)
    return zerompi.ZeroConfig(**{**base, **kw})


def gathered_vs_exact(engine) -> tuple[float, bool]:
    """Each bucket's decoded full parameters against the exact compute-dtype ones (the master, rounded),
    by the bound of the owners' scales; and whether every rank holds the same decoded values."""
    worst, digests = 0.0, []
    for i, c in enumerate(engine.sharded.collectives):
        b, codes = c.bucket, c.weight_codes
        if codes is None:
            continue
        with engine.optimizer.shard_state(i):  # an offloaded master is in memory for the block
            exact = c.full_master().to(b.storage.dtype).double()
        # every owner's scales, in the order of the shards in the bucket (the shard group's ranks)
        scales = torch.cat([torch.tensor(s) for s in c.shard_group.allgather_object(codes.scales().tolist())])
        bound = codes.codec.max_error(scales).repeat_interleave(codes.codec.block).double()
        chunk, blocks = codes.chunk, codes.codec.blocks(codes.chunk)
        bound = torch.cat([bound[r * blocks * codes.codec.block:][:chunk] for r in range(len(scales) // blocks)])
        c.unshard()
        full = b.param_full.tensor.double()
        if b.storage.dtype != torch.float32:
            bound = bound + full.abs() * torch.finfo(b.storage.dtype).eps / 2
        worst = max(worst, float(((full - exact).abs() / bound.clamp_min(1e-300)).max()))
        digests.append(b.param_full.tensor.view(torch.uint8).clone().numpy().tobytes())  # a copy: numpy pins storage
        c.reshard()
    same = len({tuple(d) for d in gather(digests)}) == 1
    return max(gather(worst)), same


def train_row(name: str, ref: bool = False, **kw) -> dict:
    """``ref``: also train unquantized, for the distance from it and the state bytes quantisation adds."""
    cfg = config(**kw)
    batches = token_batches(7, world, STEPS, cfg.grad_accum_steps)
    model = tiny_gpt(seed=1)
    init = initial_params(model)
    engine = zerompi.initialize(model, cfg)
    run = engine_train(engine, batches)
    bytes_sent = dict(engine.stats.bytes_sent)  # before the checks below gather again
    worst, same = gathered_vs_exact(engine)
    buckets = [dict(padded=b.layout.padded_numel, shard=b.layout.shard_numel, sharded=b.plan.shard_params)
               for b in engine.sharded.buckets]
    row = dict(case=f"train/{name}", world=world, stage=cfg.stage, steps=STEPS, accum=cfg.grad_accum_steps,
               quantize_weights=cfg.quantize_weights.value, quantize_grads=cfg.quantize_grads.value,
               block=cfg.quant_block, hierarchy=cfg.hierarchy.value, ranks_per_node=cfg.ranks_per_node,
               bytes_sent=bytes_sent, buckets=buckets, digest=digest(run), gather_ratio=worst,
               replicas_equal=same, losses=run.losses, state_bytes=engine.stats.model_state_bytes)
    engine.close()
    if ref:
        plain = config(**{k: v for k, v in kw.items() if k not in (
            "quantize_weights", "quantize_grads", "grad_error_feedback", "quant_block")})
        ref_engine = zerompi.initialize(tiny_gpt(seed=1), plain)
        ref_run = engine_train(ref_engine, batches)
        row.update(rel_to_unquantized=rel_to_update(run.params, ref_run.params, init),
                   ref_state_bytes=ref_engine.stats.model_state_bytes)
        ref_engine.close()
    return row


nvme = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="zq-nvme") if rank == 0 else None)
W8G4EF = dict(quantize_weights="int8", quantize_grads="int4", grad_error_feedback=True)
if args.rows in ("all", "core"):
    for stage in (1, 2, 3):
        rows.append(train_row(f"s{stage}-w8g8", ref=True, stage=stage, quantize_weights="int8", quantize_grads="int8"))
        rows.append(train_row(f"s{stage}-w8g4ef", ref=True, stage=stage, **W8G4EF))
    rows.append(train_row("s3-w8g8-bf16-accum2", quantize_weights="int8", quantize_grads="int8", dtype="bf16",
                          grad_accum_steps=2))
    rows.append(train_row("s3-w8g4ef-hpz1", hierarchy="hpz", ranks_per_node=1, **W8G4EF))
if args.rows == "all":
    rows.append(train_row("s3-w8", quantize_weights="int8"))
    rows.append(train_row("s3-g4", quantize_grads="int4", quant_block=64))
    rows.append(train_row("s2-w8g8-bf16-accum2", stage=2, quantize_weights="int8", quantize_grads="int8",
                          dtype="bf16", grad_accum_steps=2))
    rows.append(train_row("s3-w8g4ef-persist", param_persistence_threshold=17, **W8G4EF))
    rows.append(train_row("s3-w8g4ef-overlap", overlap_grad_reduce=True, prefetch_units=2, mpi_progress="test",
                          **W8G4EF))
    rows.append(train_row("s3-w8g4ef-thread", overlap_grad_reduce=True, prefetch_units=2, mpi_progress="thread",
                          **W8G4EF))
    rows.append(train_row("s3-w8g4ef-cpu", offload_optimizer="cpu", offload_params="cpu", **W8G4EF))
    rows.append(train_row("s3-w8g4ef-nvme", offload_optimizer="nvme", offload_params="nvme", nvme_path=nvme,
                          **W8G4EF))
    rows.append(train_row("s2-w8g4ef-nvme", stage=2, offload_optimizer="nvme", nvme_path=nvme, **W8G4EF))
    rows.append(train_row("s2-w8g4ef-overlap", stage=2, overlap_grad_reduce=True, mpi_progress="test", **W8G4EF))
if args.rows == "hpz":
    rows.append(train_row("s3-w8g4ef-hpz", ref=True, hierarchy="hpz", ranks_per_node=2, **W8G4EF))
    rows.append(train_row("s3-w8g4ef-hpz-overlap", hierarchy="hpz", ranks_per_node=2, overlap_grad_reduce=True,
                          prefetch_units=2, mpi_progress="test", **W8G4EF))
    rows.append(train_row("s3-w8g8-hsdp", hierarchy="hsdp", ranks_per_node=2, quantize_weights="int8",
                          quantize_grads="int8"))
    rows.append(train_row("s2-w8g8-hsdp", stage=2, hierarchy="hsdp", ranks_per_node=2, quantize_weights="int8",
                          quantize_grads="int8"))


# ---- checkpoints: a resume is bitwise; another world size drops the residuals ---------------

def resume_row(stage: int) -> dict:
    cfg = config(stage=stage, **W8G4EF)
    root = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="zq-ckpt") if rank == 0 else None)
    batches = token_batches(7, world, 4, 1)
    engine = zerompi.initialize(tiny_gpt(seed=1), cfg)
    engine_train(engine, batches[:2])
    engine.save_checkpoint(root, tag="mid")
    residual_norm = sum(float(r.norm()) for _, r in engine.sharded.residuals())
    straight = engine_train(engine, batches[2:])
    engine.close()
    engine = zerompi.initialize(tiny_gpt(seed=2), cfg)
    engine.load_checkpoint(root, tag="mid")
    resumed = engine_train(engine, batches[2:])
    engine.close()
    row = dict(case=f"ckpt/s{stage}", world=world, bitwise=digest(straight) == digest(resumed),
               residual_norm=residual_norm)
    if rank == 0:  # the same checkpoint into one rank: masters load, residuals start from zero
        single = zerompi.initialize(tiny_gpt(seed=3), cfg, comm=MPI.COMM_SELF)
        for _, r in single.sharded.residuals():
            r.fill_(1.0)
        single.load_checkpoint(root, tag="mid")
        row["other_world_residuals"] = [float(r.abs().max()) for _, r in single.sharded.residuals()]
        row["other_world_loaded"] = {k: float(v.abs().max()) for k, v in single.full_state_dict().items()}
        single.close()
    MPI.COMM_WORLD.Barrier()
    return row


if args.rows in ("all", "core"):
    rows.append(resume_row(3))
if args.rows == "all":
    rows.append(resume_row(1))


# ---- non-finite gradients are reported, not hidden by a scale -------------------------------

def nonfinite_row(name: str, **kw) -> dict:
    cfg = config(quantize_grads="int8", grad_error_feedback=True, **kw)
    engine = zerompi.initialize(tiny_gpt(seed=1), cfg)
    weight = engine.module.transformer.h[1].mlp.c_fc.weight
    batches = token_batches(7, world, 3, 1)
    error, stepped, after_skip = None, [], None
    for i, (batch,) in enumerate(batches):
        x, y = (t[rank * 4:(rank + 1) * 4] for t in batch)
        handle = weight.register_hook(lambda g: g * float("nan")) if (i == 1 and rank == world - 1) else None
        try:
            engine.backward(engine(x, y)[1])
            stepped.append(engine.step())
            if not stepped[-1]:  # a skipped step leaves no residual behind
                after_skip = max(gather(max(float(r.abs().max()) for _, r in engine.sharded.residuals())))
        except ZeroMPIError as e:
            error = str(e)
            break
        finally:
            if handle is not None:
                handle.remove()
    residuals_finite = all(bool(torch.isfinite(r).all()) for _, r in engine.sharded.residuals())
    params_finite = all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict().values())
    row = dict(case=f"nonfinite/{name}", world=world, error=error, stepped=stepped,
               skipped=engine.stats.skipped_steps, loss_scale=engine.stats.loss_scale, residual_after_skip=after_skip,
               residuals_finite=all(gather(residuals_finite)), params_finite=params_finite)
    engine.close()
    return row


logging.getLogger("zerompi").setLevel(logging.ERROR)  # the skip warnings are expected here
if args.rows in ("all", "core"):
    rows.append(nonfinite_row("raise"))
if args.rows == "all":
    rows.append(nonfinite_row("skip", nonfinite="skip"))
    rows.append(nonfinite_row("fp16", dtype="fp16"))

if rank == 0:
    write_json(args.out, rows)
