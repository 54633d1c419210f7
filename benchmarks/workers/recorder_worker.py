"""The hang recorder's cost: stage-3 GPT steps with the ring on (as shipped) and off, alternating.

'off' replaces the recorder's ``begin`` by one returning a shared event (what the ring costs is
then gone; the watchdog thread, waking once a second, runs in both). Rank 0 also times ``begin``
plus the end-time stamp alone. Writes one JSON object (rank 0) to --out.
"""
import argparse
import json
import statistics
import time

import torch
from mpi4py import MPI

import zerompi
from zerompi.comm.recorder import Event
from zerompi.models.gpt import GPT, GPTConfig

COMM = MPI.COMM_WORLD


def per_begin_ns(recorder) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20000):
            recorder.begin("all_gather", "", "bucket 3 [h.0.attn.weight ...] of module 'h.0'", 4096).end = \
                time.monotonic()
        best = min(best, (time.perf_counter() - t) / 20000)
    return best * 1e9


def run_steps(engine, batch, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        COMM.Barrier()
        t = time.perf_counter()
        loss = engine(*batch)[1]
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=0.25)
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128))
    engine = zerompi.initialize(model, zerompi.ZeroConfig(stage=3, bucket_mb=args.bucket_mb, optimizer="adamw"))
    batch = (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64)))
    recorder = engine.group.monitor.recorder
    shipped, dummy = recorder.begin, Event(0, "", "", "", 0, 0.0, 0)
    run_steps(engine, batch, 3)  # warm-up
    before = recorder.count
    times = {"on": [], "off": []}
    for i in range(args.rounds):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):  # no mode always goes first
            recorder.begin = shipped if mode == "on" else (lambda *a: dummy)
            times[mode] += run_steps(engine, batch, args.steps)
    recorder.begin = shipped
    events = (recorder.count - before) / (args.rounds * args.steps)  # 'on' steps only counted
    ns = per_begin_ns(recorder)
    if COMM.rank == 0:
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        row = {"ranks": COMM.size, "steps": args.rounds * args.steps, "events_per_step": events,
               "begin_ns": round(ns), "step_ms_on": round(on * 1e3, 2), "step_ms_off": round(off * 1e3, 2),
               "estimated_pct": round(100 * events * ns * 1e-9 / on, 4),
               "measured_pct": round(100 * (on - off) / off, 2)}
        with open(args.out, "w") as f:
            json.dump(row, f)
    engine.close()


if __name__ == "__main__":
    main()
