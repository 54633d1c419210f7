"""Train a small GPT on the Python stdlib's source, ZeRO data-parallel over MPI.

    mpiexec -n 2 python -m mpi4py jobs/train_gpt.py \
        [--config jobs/configs/default.toml] [--steps N] [--out DIR] [--stage S]

The TOML config has three tables: [model] (GPTConfig fields), [train] (this
loop's settings, see TRAIN_DEFAULTS) and [zero] (zerompi.ZeroConfig fields).
Every rank draws its own micro-batches; one optimizer step covers
world_size * grad_accum_steps * micro_batch sequences. Rank 0 shows progress
on stderr and writes one JSON object per log_every steps to
{out_dir}/metrics.jsonl ("bytes_sent_total" is cumulative since the start,
"bytes_sent_per_step" the mean over the steps since the previous record).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

import zerompi
from zerompi.errors import ConfigError
from zerompi.models.corpus import ByteCorpus
from zerompi.models.gpt import GPT, gpt_config_from_dict

log = logging.getLogger("train_gpt")

TRAIN_DEFAULTS = dict(steps=100, micro_batch=8, log_every=10, eval_every=50, eval_batches=4,
                      out_dir="out/train_gpt", data_max_bytes=0, seed=1337,  # 0 bytes: no cap
                      save_every=0, ckpt_dir="")  # 0: no periodic checkpoints; "": {out_dir}/checkpoints
EVAL_STREAM = 2**31 - 1  # a "step" no training step reaches: eval draws never repeat train draws


def load_config(path: str) -> tuple[dict, dict, dict]:
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    unknown = sorted(set(doc) - {"model", "train", "zero"}) + \
        sorted(f"train.{k}" for k in set(doc.get("train", {})) - set(TRAIN_DEFAULTS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}")
    return doc.get("model", {}), {**TRAIN_DEFAULTS, **doc.get("train", {})}, doc.get("zero", {})


def generator(*coords: int) -> torch.Generator:
    # A fresh generator per draw, seeded from the draw's coordinates (seed, step,
    # micro-step, rank): a batch does not depend on how many were drawn before,
    # so runs repeat exactly and ranks never share a batch.
    state = np.random.SeedSequence([int(c) for c in coords]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def evaluate(engine, data: ByteCorpus, train: dict, block_size: int) -> float:
    engine.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(train["eval_batches"]):
            # The same val batches at every evaluation, so the curve shows the model change, not sampling noise.
            x, y = data.get_batch("val", train["micro_batch"], block_size,
                                  generator(train["seed"], EVAL_STREAM, i, engine.rank))
            total += engine(x, y)[1].item()
    engine.train()
    return engine.all_reduce_mean(total / train["eval_batches"])


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="jobs/configs/default.toml")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--out", help="override train.out_dir")
    p.add_argument("--stage", type=int, help="override zero.stage")
    p.add_argument("--save-every", type=int, help="override train.save_every (steps between checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in the checkpoint directory, if there is one")
    args = p.parse_args(argv)
    preemption = Preemption()

    rank0 = MPI.COMM_WORLD.Get_rank() == 0
    logging.basicConfig(level=os.environ.get("ZEROMPI_LOG_LEVEL", "WARNING"),
                        format=f"[rank {MPI.COMM_WORLD.Get_rank()}] %(levelname)s %(name)s: %(message)s")
    model_doc, train, zero_doc = load_config(args.config)
    train.update({k: v for k, v in (("steps", args.steps), ("out_dir", args.out), ("save_every", args.save_every))
                  if v is not None})
    gpt_cfg = gpt_config_from_dict(model_doc)
    cfg = zerompi.ZeroConfig.from_dict(zero_doc)
    if args.stage is not None:
        cfg = cfg.replace(stage=args.stage)

    # Every rank must start from the same weights; the engine checks that they do.
    torch.manual_seed(train["seed"])
    model = GPT(gpt_cfg)
    data = ByteCorpus(max_bytes=train["data_max_bytes"] or None)
    engine = zerompi.initialize(model, cfg)
    log.info("GPT with %.2fM parameters, corpus %d bytes, %s", model.num_params() / 1e6, len(data), cfg)

    out_dir = Path(train["out_dir"])
    ckpt_dir = Path(train["ckpt_dir"] or out_dir / "checkpoints")
    first_step = 1
    if args.resume and (ckpt_dir / "latest").exists():
        first_step = engine.load_checkpoint(ckpt_dir)["next_step"]
        log.warning("resumed from %s at step %d", ckpt_dir, first_step)
    metrics = None
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(
            {"model": vars(gpt_cfg), "train": train, "zero": cfg.to_dict(),
             "world_size": engine.world_size}, indent=2, default=str))
        metrics = open(out_dir / "metrics.jsonl", "a" if first_step > 1 else "w")

    steps, T, accum = train["steps"], gpt_cfg.block_size, cfg.grad_accum_steps
    tokens_per_step = engine.world_size * accum * train["micro_batch"] * T
    first_loss = loss = val_loss = None
    train_time = 0.0  # excludes evaluation, so tokens/s measures training alone
    last = dict(step=first_step - 1, time=0.0, sent=dict(engine.stats.bytes_sent))
    start = time.perf_counter()
    step = first_step - 1
    for step in range(first_step, steps + 1):
        t0 = time.perf_counter()
        step_loss = 0.0
        for micro in range(accum):
            x, y = data.get_batch("train", train["micro_batch"], T,
                                  generator(train["seed"], step, micro, engine.rank))
            _, micro_loss = engine(x, y)
            engine.backward(micro_loss)
            stepped = engine.step()  # a no-op until the last micro-batch of the step
            step_loss += micro_loss.item() / accum
        if not stepped:
            log.info("step %d: optimizer step skipped (loss scale %g)", step, engine.stats.loss_scale)
        # A tiny collective every step, so every rank takes part whatever rank 0 shows.
        loss = engine.all_reduce_mean(step_loss)
        train_time += time.perf_counter() - t0
        first_loss = loss if first_loss is None else first_loss
        elapsed = time.perf_counter() - start
        tok_s = (step - first_step + 1) * tokens_per_step / train_time

        sent = dict(engine.stats.bytes_sent)  # before evaluating: count training traffic only
        evaluating = train["eval_every"] > 0 and (step % train["eval_every"] == 0 or step == steps)
        val_loss = evaluate(engine, data, train, T) if evaluating else val_loss
        stop = preemption.agreed(engine)
        if stop or (train["save_every"] > 0 and (step % train["save_every"] == 0 or step == steps)):
            engine.save_checkpoint(ckpt_dir, client_state={"next_step": step + 1})
        if stop:
            if rank0:
                print(f"preempted: checkpoint at step {step} in {ckpt_dir}; rerun with --resume", flush=True)
            break
        if not rank0:
            continue
        lr = engine.get_lr()[0]  # what the next step uses
        line = f"step {step}/{steps} | loss {loss:.3f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | {elapsed:.1f}s"
        if evaluating:
            line += f" | val {val_loss:.3f}"
        if step % train["log_every"] == 0 or step in (1, steps) or evaluating:
            interval = step - last["step"]
            record = dict(step=step, loss=loss, lr=lr,
                          tokens_per_s=interval * tokens_per_step / (train_time - last["time"]),
                          model_state_bytes=engine.stats.model_state_bytes,
                          bytes_sent_total=sent,
                          bytes_sent_per_step={k: (v - last["sent"].get(k, 0)) // interval
                                               for k, v in sent.items()},
                          skipped_steps=engine.stats.skipped_steps,
                          loss_scale=engine.stats.loss_scale, elapsed_s=round(elapsed, 3))
            if evaluating:
                record["val_loss"] = val_loss
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            last = dict(step=step, time=train_time, sent=sent)
            progress(line, final=True)
        else:
            progress(line)

    if rank0 and first_loss is None:
        print(f"nothing to do: the checkpoint is already at step {first_step - 1} of {steps}", flush=True)
    elif rank0:
        metrics.close()
        val = f" (val {val_loss:.3f})" if val_loss is not None else ""
        done = step - first_step + 1
        print(f"done: {step} steps, world size {engine.world_size}, stage {cfg.stage}, "
              f"loss {first_loss:.3f} -> {loss:.3f}{val}, {done * tokens_per_step / max(train_time, 1e-9):,.0f} "
              f"tokens/s, {time.perf_counter() - start:.1f}s; metrics in {out_dir / 'metrics.jsonl'}",
              flush=True)


if __name__ == "__main__":
    main()
