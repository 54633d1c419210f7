"""What the training jobs share: flags, TOML config, run directory, the step loop, preemption.

Each job (train_gpt.py, train_cnn.py, train_classifier.py, linear_regression.py)
brings its model, its data and two functions, ``step_fn(step)`` (one optimizer
step; returns this rank's metrics) and ``eval_fn()`` (returns metrics already
averaged over ranks), and hands them to :func:`train_loop`, which times the steps,
evaluates, checkpoints (``--save-every``, SIGUSR1/SIGTERM), shows progress on rank 0
and writes ``metrics.jsonl``. A step's data must depend only on (seed, step, rank),
so that a resumed run repeats an uninterrupted one exactly.
"""
from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import signal
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

import zerompi
from zerompi.checkpoint import retention
from zerompi.config.checks import kind_of, same_kind
from zerompi.errors import ConfigError

log = logging.getLogger("jobs")

# [train] keys every job has; a job adds its own to these defaults.
LOOP_DEFAULTS = dict(steps=100, log_every=10, eval_every=50, seed=1337,
                     save_every=0, ckpt_dir="",  # 0: no periodic checkpoints; "": {out_dir}/checkpoints
                     keep_last=0,  # 0: every checkpoint is kept; K: the K newest complete ones (and one in flight)
                     async_save=True)  # periodic checkpoints written on a background thread while training goes on
LATEST = "latest"  # --resume without a tag
EVAL_STREAM = 2**31 - 1  # a "step" no training step reaches: eval draws never repeat train draws


def parse_args(doc: str, default_config: str, argv: list[str] | None = None, *,
               reproducible: bool = False) -> argparse.Namespace:
    """The flags every job takes; ``reproducible``: also --reproducible and --micro-batches (jobs whose
    micro-batches are drawn by global index, with micro_batches())."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--config", default=default_config)
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--out", help="override train.out_dir")
    p.add_argument("--stage", type=int, help="override zero.stage")
    p.add_argument("--save-every", type=int, help="override train.save_every (steps between checkpoints)")
    p.add_argument("--keep-last", type=int, metavar="K", help="override train.keep_last (keep the K newest "
                   "checkpoints, remove older ones; 0 keeps all)")
    p.add_argument("--resume", nargs="?", const=LATEST, default=None, metavar="TAG",
                   help="continue from the latest checkpoint in the checkpoint directory, if there is one; with "
                        "TAG, from that one (it must exist: `zerompi ckpt inspect DIR` lists them)")
    if reproducible:
        p.add_argument("--reproducible", action="store_true",
                       help="train the same bits at any world size (zero.reproducible): micro-batch i of a step "
                            "is drawn from (seed, step, i) whichever rank runs it")
        p.add_argument("--micro-batches", type=int, help="with --reproducible: micro-batches per step over all "
                       "ranks (default: world size x grad_accum_steps); keep it when resuming elsewhere")
    p.set_defaults(reproducible=False, micro_batches=None)
    return p.parse_args(argv)


def setup_logging() -> bool:
    """Rank-prefixed logging at $ZEROMPI_LOG_LEVEL (default WARNING); True on rank 0."""
    rank = MPI.COMM_WORLD.Get_rank()
    logging.basicConfig(level=os.environ.get("ZEROMPI_LOG_LEVEL", "WARNING"),
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    return rank == 0


def load_config(path: str, train_defaults: dict) -> tuple[dict, dict, dict]:
    """The [model], [train] and [zero] tables; unknown tables or [train] keys, and [train] values of
    another kind than their defaults, are errors naming the file."""
    global CONFIG_PATH
    CONFIG_PATH = path
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read it: {e}") from None
    unknown = sorted(set(doc) - {"model", "train", "zero"}) + \
        sorted(f"train.{k}" for k in set(doc.get("train", {})) - set(train_defaults))
    if unknown:
        near = {k: difflib.get_close_matches(k.removeprefix("train."), list(train_defaults), 1) for k in unknown}
        named = ", ".join(f"{k} (did you mean train.{near[k][0]}?)" if near[k] else k for k in unknown)
        raise ConfigError(f"unknown key(s) {named}; [train] keys: {', '.join(sorted(train_defaults))}")
    for key, value in doc.get("train", {}).items():
        if not same_kind(value, train_defaults[key]):
            raise ConfigError(f"train.{key}: expected {kind_of(train_defaults[key])}, got {value!r}")
    return doc.get("model", {}), {**train_defaults, **doc.get("train", {})}, doc.get("zero", {})


CONFIG_PATH: str | None = None  # the job's config file, once load_config read it (for error messages)


def job_main(main: Callable[[], object]) -> None:
    """A job's entry point: a ConfigError (a wrong key, kind or value in the config file or a flag) is one
    short message naming the file, on rank 0, and exit status 2 on every rank, not a traceback per rank."""
    try:
        main()
    except ConfigError as e:
        if MPI.COMM_WORLD.Get_rank() == 0:
            where = f" in {CONFIG_PATH} or its flags" if CONFIG_PATH else ""
            print(f"{Path(sys.argv[0]).name}: configuration error{where}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def apply_flags(args: argparse.Namespace, train: dict, zero_doc: dict) -> zerompi.ZeroConfig:
    """Command-line overrides of [train] (in place) and [zero]; returns the ZeroConfig."""
    train.update({k: v for k, v in (("steps", args.steps), ("out_dir", args.out), ("save_every", args.save_every),
                                    ("keep_last", args.keep_last)) if v is not None})
    if not isinstance(train["keep_last"], int) or train["keep_last"] < 0:
        raise ConfigError(f"train.keep_last (--keep-last) must be a whole number >= 0 (0 keeps every checkpoint), "
                          f"got {train['keep_last']!r}")
    cfg = zerompi.ZeroConfig.from_dict(zero_doc)
    if args.stage is not None:
        cfg = cfg.replace(stage=args.stage)
    if args.micro_batches is not None and not args.reproducible:
        raise ConfigError("--micro-batches sets the global batch of --reproducible; add --reproducible")
    if args.reproducible:  # the rank count no longer sets the batch: G micro-batches, dealt over the ranks
        g = args.micro_batches or MPI.COMM_WORLD.Get_size() * cfg.grad_accum_steps
        cfg = cfg.replace(reproducible=True, micro_batches=g, grad_accum_steps=1, cpu_threads=cfg.cpu_threads or 1)
    return cfg


def micro_batches(engine, seed: int, step: int) -> list[torch.Generator]:
    """The generators of the micro-batches this rank runs at ``step``, in order. reproducible=True:
    global micro-batch i is drawn from (seed, step, i), whichever rank runs it, so the data of a step
    does not depend on the world size; otherwise each rank draws grad_accum_steps of its own."""
    if engine.config.reproducible:
        return [generator(seed, step, i) for i in engine.micro_batch_indices()]
    return [generator(seed, step, micro, engine.rank) for micro in range(engine.config.grad_accum_steps)]


def micro_batches_per_step(engine) -> int:
    """Micro-batches per optimizer step over all ranks."""
    cfg = engine.config
    return cfg.micro_batches if cfg.reproducible else engine.world_size * cfg.grad_accum_steps


def generator(*coords: int) -> torch.Generator:
    # A fresh generator per draw, seeded from the draw's coordinates (seed, step,
    # micro-step, rank): a batch does not depend on how many were drawn before,
    # so runs repeat exactly and ranks never share a batch.
    state = np.random.SeedSequence([int(c) for c in coords]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def shard_indices(n: int, global_batch: int, step: int, seed: int, rank: int, world: int) -> torch.Tensor:
    """This rank's examples of global batch ``step`` (1-based) over a dataset of ``n``.

    Like torch's DistributedSampler: each epoch is a permutation seeded by (seed,
    epoch); the epoch's batches are consecutive slices of it (the last partial one
    is dropped) and each rank takes every world-th example of a batch.
    """
    per_epoch = n // global_batch
    if per_epoch == 0:
        raise ConfigError(f"a global batch of {global_batch} is larger than the {n} training examples")
    epoch, i = divmod(step - 1, per_epoch)
    order = torch.randperm(n, generator=generator(seed, epoch))
    return order[i * global_batch:(i + 1) * global_batch][rank::world]


def share(local: int, global_batch: int, world: int) -> float:
    """The weight of this rank's mean loss over its ``local`` examples such that the engine's average over
    ranks is the mean over the global batch: ``local * world / global_batch`` (1 where the shares are even).
    Uneven shares (2,048 rows on 3 ranks) weighted equally would bias the gradient toward the smaller ones."""
    return local * world / global_batch


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm running statistics) to every rank, as DDP does before each forward.

    Each rank normalises with its own batch's statistics, but the running statistics
    that evaluation uses, and that a checkpoint saves (rank 0's), are the same everywhere,
    so a resumed run repeats an uninterrupted one.
    """
    for buf in module.buffers():
        MPI.COMM_WORLD.Bcast(buf.detach().numpy(), root=0)


def corpus_val_loss(engine, data, train: dict, block_size: int, loss_fn) -> dict:
    """Mean ``loss_fn(engine, x, y)`` over ``train["eval_batches"]`` val batches of a ByteCorpus per rank,
    averaged over ranks: the same batches at every evaluation, so the curve shows the model change."""
    engine.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(train["eval_batches"]):
            x, y = data.get_batch("val", train["micro_batch"], block_size,
                                  generator(train["seed"], EVAL_STREAM, i, engine.rank))
            total += float(loss_fn(engine, x, y))
    engine.train()
    return {"val_loss": engine.all_reduce_mean(total / train["eval_batches"])}


def test_metrics(engine, n: int, mean_loss: float, correct: int | None = None) -> dict:
    """val_loss (and val_accuracy) over every rank's n test examples: sums over ranks (the
    mean times world_size), since the ranks' shares of a test set may differ by one."""
    world = engine.world_size
    total = engine.all_reduce_mean(n) * world
    out = {"val_loss": engine.all_reduce_mean(mean_loss * n) * world / total}
    if correct is not None:
        out["val_accuracy"] = engine.all_reduce_mean(correct) * world / total
    return out


def progress(text: str, final: bool = False) -> None:
    # On a terminal redraw one line in place; in a log file write whole lines.
    if sys.stderr.isatty():
        sys.stderr.write("\r" + text.ljust(80) + ("\n" if final else ""))
        sys.stderr.flush()
    elif final:
        print(text, file=sys.stderr, flush=True)


class Preemption:
    """SIGUSR1 (Slurm's warning before walltime) or SIGTERM: checkpoint at the next step, exit 0."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum, _frame) -> None:
        self.requested = True  # acted on at a step boundary, where all ranks agree

    def agreed(self, engine) -> bool:
        # One tiny collective: a signal that reached only some ranks still stops all of them.
        return engine.all_reduce_mean(float(self.requested)) > 0


@dataclass
class Run:
    """One job's run: where it writes, where it resumes, and what a step processes."""
    engine: zerompi.Engine
    train: dict
    out_dir: Path
    ckpt_dir: Path
    first_step: int
    unit: str                      # "tokens" or "samples": what the throughput counts
    per_step: int                  # units per optimizer step, over all ranks
    preemption: Preemption
    include_frozen: bool = True    # False: checkpoints leave the frozen base out (fine-tuning jobs)
    rank0: bool = field(init=False)

    def __post_init__(self) -> None:
        self.rank0 = self.engine.rank == 0


def topology_line(engine) -> str:
    """Collective: the nodes the engine found (ranks sharing memory, MPI_COMM_TYPE_SHARED), by host name."""
    info = engine.info
    per_node = engine.group.allgather_object((info.node_rank, MPI.Get_processor_name(), info.local_size))
    nodes = sorted(set(per_node))
    sizes = {size for _, _, size in nodes}
    if len(sizes) == 1:
        size = sizes.pop()
        shape = f"{info.num_nodes} node{'s' if info.num_nodes > 1 else ''} x {size} rank{'s' if size > 1 else ''} " \
                f"({', '.join(name for _, name, _ in nodes)})"
    else:
        shape = f"{info.num_nodes} nodes ({', '.join(f'{name}: {size} ranks' for _, name, size in nodes)})"
    topology = engine.config.topology
    grouping = f", ranks_per_node={topology.ranks_per_node}" if topology.ranks_per_node else ""
    return f"topology: world size {info.world_size} on {shape}, hierarchy {topology.hierarchy}{grouping}"


def start_run(engine, train: dict, config: dict, resume: str | None, unit: str, per_step: int,
              preemption: Preemption, first_step: int = 1, include_frozen: bool = True) -> Run:
    """Resume if asked (``resume``: LATEST, the latest checkpoint if there is one, or a tag that must exist);
    on rank 0 write config.json.

    ``first_step`` > 1 continues a run (a later phase of the same job): metrics are appended.
    ``include_frozen=False``: the run's checkpoints hold what training changes, not the frozen base.
    """
    out_dir = Path(train["out_dir"])
    ckpt_dir = Path(train["ckpt_dir"] or out_dir / "checkpoints")
    if resume is not None and (resume != LATEST or (ckpt_dir / "latest").exists()):
        tag = None if resume == LATEST else resume
        first_step = engine.load_checkpoint(ckpt_dir, tag=tag)["next_step"]
        log.warning("resumed from %s at step %d", ckpt_dir if tag is None else ckpt_dir / tag, first_step)
    run = Run(engine, train, out_dir, ckpt_dir, first_step, unit, per_step, preemption, include_frozen)
    layout = topology_line(engine)
    if run.rank0:
        print(layout, flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(
            {**config, "train": train, "zero": engine.config.to_dict(), "world_size": engine.world_size},
            indent=2, default=str))
    return run


StepFn = Callable[[int], dict]      # step -> this rank's {"loss": ..., maybe "accuracy": ...}
EvalFn = Callable[[], dict]         # -> {"val_loss": ..., maybe "val_accuracy": ...}, averaged over ranks
ExtraFn = Callable[[int], dict]     # steps since the last record -> more fields of this record


class LoopResult(NamedTuple):
    metrics: dict     # the last step's metrics and the last evaluation's (empty when there was nothing to do)
    completed: bool   # False when preempted: the job should stop without a final report


def train_loop(run: Run, step_fn: StepFn, eval_fn: EvalFn | None, extra: ExtraFn | None = None) -> LoopResult:
    """Steps first_step..steps, evaluating, checkpointing and logging on the way."""
    engine, train = run.engine, run.train
    steps, rate_key = train["steps"], f"{run.unit}_per_s"
    metrics = open(run.out_dir / "metrics.jsonl", "a" if run.first_step > 1 else "w") if run.rank0 else None
    first = last = {}
    val: dict = {}
    train_time = 0.0  # excludes evaluation, so the rate measures training alone
    mark = dict(step=run.first_step - 1, time=0.0)
    start = time.perf_counter()
    step, stop = run.first_step - 1, False
    for step in range(run.first_step, steps + 1):
        t0 = time.perf_counter()
        # Tiny collectives every step, so every rank takes part whatever rank 0 shows.
        last = {k: engine.all_reduce_mean(v) for k, v in step_fn(step).items()}
        train_time += time.perf_counter() - t0
        first = first or last
        elapsed = time.perf_counter() - start
        rate = (step - run.first_step + 1) * run.per_step / train_time

        evaluating = eval_fn is not None and train["eval_every"] > 0 and (step % train["eval_every"] == 0
                                                                          or step == steps)
        logging_step = step % train["log_every"] == 0 or step in (1, steps) or evaluating
        fields = extra(step - mark["step"]) if extra is not None and logging_step else {}  # before evaluating
        val = eval_fn() if evaluating else val
        stop = run.preemption.agreed(engine)
        if stop or (train["save_every"] > 0 and (step % train["save_every"] == 0 or step == steps)):
            # Periodic checkpoints are written in the background; the preemption checkpoint is not (the
            # job exits next), and any save still in flight is waited for before a new one starts.
            engine.save_checkpoint(run.ckpt_dir, client_state={"next_step": step + 1},
                                   include_frozen=run.include_frozen,
                                   async_save=train["async_save"] and not stop)
            if train["keep_last"] and run.rank0:  # of the published ones: the save just begun is not yet
                retention.prune(run.ckpt_dir, train["keep_last"])
        if stop:
            if run.rank0:
                print(f"preempted: checkpoint at step {step} in {run.ckpt_dir}; rerun with --resume", flush=True)
            break
        if not run.rank0:
            continue
        lr = engine.get_lr()[0]  # what the next step uses
        short = "tok" if run.unit == "tokens" else run.unit
        line = f"step {step}/{steps} | loss {last['loss']:.3f} | lr {lr:.2e} | {rate:,.0f} {short}/s | {elapsed:.1f}s"
        if evaluating:
            line += "".join(f" | {'val' if k == 'val_loss' else k.removeprefix('val_')[:3]} {v:.3f}"
                            for k, v in val.items())
        if logging_step:
            interval = step - mark["step"]
            record = dict(step=step, **last, lr=lr,
                          **{rate_key: interval * run.per_step / (train_time - mark["time"])},
                          **fields, elapsed_s=round(elapsed, 3))
            if evaluating:
                record.update(val)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            mark = dict(step=step, time=train_time)
            progress(line, final=True)
        else:
            progress(line)

    engine.wait_checkpoint()  # the last periodic checkpoint is published (or its failure raised) before the report
    if train["keep_last"] and run.rank0:
        retention.prune(run.ckpt_dir, train["keep_last"])  # while one is written, K + 1 are on disk; now K
    if run.rank0 and not first:
        print(f"nothing to do: the checkpoint is already at step {run.first_step - 1} of {steps}", flush=True)
    elif run.rank0:
        metrics.close()
        shown = f" (val {val['val_loss']:.3f})" if "val_loss" in val else ""
        done = step - run.first_step + 1
        print(f"done: {step} steps, world size {engine.world_size}, stage {engine.config.stage}, "
              f"loss {first['loss']:.3f} -> {last['loss']:.3f}{shown}, "
              f"{done * run.per_step / max(train_time, 1e-9):,.0f} {run.unit}/s, "
              f"{time.perf_counter() - start:.1f}s; metrics in {run.out_dir / 'metrics.jsonl'}", flush=True)
    return LoopResult({**last, **val}, not stop)
