"""Train a small GPT on the Python stdlib's source, ZeRO data-parallel over MPI.

    mpiexec -n 2 python -m mpi4py jobs/train_gpt.py \
        [--config jobs/configs/default.toml] [--steps N] [--out DIR] [--stage S]
        [--reproducible [--micro-batches G]]

The TOML config has three tables: [model] (GPTConfig fields), [train] (this
loop's settings, see TRAIN_DEFAULTS) and [zero] (zerompi.ZeroConfig fields).
Every rank draws its own micro-batches; one optimizer step covers
world_size * grad_accum_steps * micro_batch sequences. With --reproducible, a step is G global
micro-batches dealt over the ranks, and the trained model is the same at any world size. Rank 0 shows progress
on stderr and writes one JSON object per log_every steps to
{out_dir}/metrics.jsonl ("bytes_sent_total" is cumulative since the start,
"bytes_sent_per_step" the mean over the steps since the previous record).
"""
from __future__ import annotations

import logging

import torch

import zerompi
from common import (LOOP_DEFAULTS, Preemption, apply_flags, corpus_val_loss, job_main, load_config, micro_batches,
                    micro_batches_per_step, parse_args, setup_logging, start_run, train_loop)
from zerompi.models.corpus import ByteCorpus
from zerompi.models.gpt import GPT, gpt_config_from_dict

log = logging.getLogger("train_gpt")

TRAIN_DEFAULTS = dict(LOOP_DEFAULTS, micro_batch=8, eval_batches=4, out_dir="out/train_gpt",
                      data_max_bytes=0)  # 0 bytes: no cap


def traffic(engine):
    """Bytes sent by kind, since the start and per step since the previous record (read before evaluating)."""
    last = dict(engine.stats.bytes_sent)

    def fields(interval: int) -> dict:
        nonlocal last
        stats = engine.stats
        sent = dict(stats.bytes_sent)
        out = dict(model_state_bytes=stats.model_state_bytes, bytes_sent_total=sent,
                   bytes_sent_per_step={k: (v - last.get(k, 0)) // interval for k, v in sent.items()},
                   skipped_steps=stats.skipped_steps, loss_scale=stats.loss_scale)
        last = sent
        return out
    return fields


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, "jobs/configs/default.toml", argv, reproducible=True)
    preemption = Preemption()
    setup_logging()
    model_doc, train, zero_doc = load_config(args.config, TRAIN_DEFAULTS)
    cfg = apply_flags(args, train, zero_doc)
    gpt_cfg = gpt_config_from_dict(model_doc)

    # The same seed on every rank: the engine starts every rank from rank 0's weights (as DDP does) and warns,
    # naming them, about ranks whose weights differed (shard/initial.py).
    torch.manual_seed(train["seed"])
    model = GPT(gpt_cfg)
    data = ByteCorpus(max_bytes=train["data_max_bytes"] or None)
    engine = zerompi.initialize(model, cfg)
    log.info("GPT with %.2fM parameters, corpus %d bytes, %s", model.num_params() / 1e6, len(data), cfg)

    T = gpt_cfg.block_size
    run = start_run(engine, train, {"model": vars(gpt_cfg)}, args.resume, "tokens",
                    micro_batches_per_step(engine) * train["micro_batch"] * T, preemption)

    def step_fn(step: int) -> dict:
        step_loss, gens = 0.0, micro_batches(engine, train["seed"], step)
        for gen in gens:
            x, y = data.get_batch("train", train["micro_batch"], T, gen)
            _, micro_loss = engine(x, y)
            engine.backward(micro_loss)
            step_loss += micro_loss.item() / len(gens)
        stepped = engine.step()
        if not stepped:
            log.info("step %d: optimizer step skipped (loss scale %g)", step, engine.stats.loss_scale)
        return {"loss": step_loss}

    train_loop(run, step_fn, lambda: corpus_val_loss(engine, data, train, T, lambda e, x, y: e(x, y)[1]),
               traffic(engine))


if __name__ == "__main__":
    job_main(main)
