"""Checkpoint worker: save mid-training, resume in a new job, or try a load that must fail.

--mode save:   train --before steps, save (client_state = the data position),
               train --after more steps; rank 0 writes the parameters at the
               save point and at the end to OUT (.npz, no pickle).
--mode resume: a fresh model with *different* initial values loads the
               checkpoint, rank 0 records the loaded parameters, trains
               --after steps from the saved data position and writes the end;
               with --orders, loads again and trains the same steps on the
               global batch in other row orders (reversed; rotated by half a
               rank's rows), for the order noise of the parity bound.
--mode fail:   load must raise CheckpointError; every rank's message goes to OUT (JSON); with
               --then-load TAG the same engine then loads TAG and rank 0 writes its parameters
               to --then-out (.npz, as saved/ of a resume).
--async-save:  save with async_save=True and train the --after steps while it writes (the
               parameters at the save point are read before the call); --slow-capture S
               delays the save's taking of each bucket by S seconds, so that the steps reach
               buckets it has not taken yet; --offload nvme puts the state in a swap file.
The global batch (GLOBAL sequences) is the same at every world size, split evenly.
--cases SPEC:  run several of these command lines, one after another, in one job (workers/cases.py).
"""
import argparse

import numpy as np
import torch
from mpi4py import MPI

import zerompi
import cases
from common import SEQ, VOCAB, gpt_loss, slow_capture, tiny_gpt, write_json

GLOBAL = 120  # divisible by 1, 2, 3, 4, 5, 6, 8
COMM = MPI.COMM_WORLD


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


ORDERS = {"flip": lambda t, rows: t.flip(0), "roll": lambda t, rows: t.roll(max(rows // 2, 1), 0)}


def train(engine, first: int, count: int, order: str | None = None) -> None:
    rows = GLOBAL // engine.world_size
    for step in range(first, first + count):
        batch = global_batch(step)
        if order:
            batch = tuple(ORDERS[order](t, rows) for t in batch)
        x, y = (t[engine.rank * rows:(engine.rank + 1) * rows] for t in batch)
        engine.backward(gpt_loss(engine, (x, y)))
        engine.step()


def config(args) -> zerompi.ZeroConfig:
    opt = {"adamw": dict(optimizer="adamw", lr=1e-2, weight_decay=0.1),
           "sgd": dict(optimizer="sgd", lr=0.2, momentum=0.9),
           "adafactor": dict(optimizer="torch.optim.Adafactor", lr=1e-2)}[args.optimizer]  # state per tensor
    offload = dict(offload_optimizer=args.offload, nvme_path=args.root + "-swap") if args.offload != "none" else {}
    return zerompi.ZeroConfig(stage=args.stage, dtype=args.dtype, bucket_mb=args.bucket_mb, **opt,
                              hierarchy=args.hierarchy, ranks_per_node=args.ranks_per_node,
                              checkpoint_layout=args.layout, checkpoint_verify=args.verify,
                              checkpoint_async_copy=args.async_copy, **offload)


def snapshot(engine) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in engine.full_state_dict().items()}


def failing_async_save(engine, args) -> None:
    """An asynchronous save whose rank file fails on one rank: what wait_checkpoint raises, per rank."""
    from zerompi.checkpoint import stores
    write = stores.write_rank_file
    if COMM.Get_rank() == args.fail_write_rank:
        def broken(*a, **k):
            raise OSError(28, "No space left on device (test)")
        stores.write_rank_file = broken
    try:
        train(engine, 0, args.before)
        engine.save_checkpoint(args.root, tag=args.tag, async_save=True)
        try:
            engine.wait_checkpoint()
            message = "no error"
        except zerompi.CheckpointError as e:
            message = f"CheckpointError: {e}"
    finally:
        stores.write_rank_file = write  # the next case of the job (workers/cases.py) writes again
    engine.close()  # nothing left in flight: no second report
    messages = COMM.allgather(message)
    if COMM.Get_rank() == 0:
        write_json(args.out, messages)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("save", "resume", "fail"), required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--bucket-mb", type=float, default=0.004)
    p.add_argument("--before", type=int, default=3)
    p.add_argument("--after", type=int, default=3)
    p.add_argument("--tag", default=None)
    p.add_argument("--model-seed", type=int, default=1)
    p.add_argument("--n-embd", type=int, default=16)
    p.add_argument("--hierarchy", default="flat")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--layout", default="auto")
    p.add_argument("--orders", action="store_true", help="resume: also train in the other orders of ORDERS")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--slow-capture", type=float, default=0.0)
    p.add_argument("--async-copy", action="store_true", help="checkpoint_async_copy=True")
    p.add_argument("--offload", default="none")
    p.add_argument("--verify", action="store_true", help="checkpoint_verify=True")
    p.add_argument("--then-load", default=None, help="fail: then load this tag (it must load)")
    p.add_argument("--then-out", default=None, help="fail: where --then-load's parameters go (.npz)")
    p.add_argument("--fail-write-rank", type=int, default=None,
                   help="async save: this rank's file write raises OSError; every rank's error goes to OUT (JSON)")
    return p


def save(engine, args, out: dict) -> None:
    train(engine, 0, args.before)
    if args.async_save:
        out.update({f"saved/{k}": v for k, v in snapshot(engine).items()})
        slow_capture(engine, args.slow_capture)
        engine.save_checkpoint(args.root, tag=args.tag, client_state={"next_step": args.before}, async_save=True)
        train(engine, args.before, args.after)  # while the save writes
        engine.wait_checkpoint()
    else:
        engine.save_checkpoint(args.root, tag=args.tag, client_state={"next_step": args.before})
        out.update({f"saved/{k}": v for k, v in snapshot(engine).items()})
        train(engine, args.before, args.after)


def resume(engine, args, out: dict) -> None:
    state = engine.load_checkpoint(args.root, tag=args.tag)
    out.update({f"saved/{k}": v for k, v in snapshot(engine).items()})
    train(engine, state["next_step"], args.after)
    for order in ORDERS if args.orders else ():
        again = zerompi.initialize(tiny_gpt(args.model_seed, n_embd=args.n_embd), config(args))
        again.load_checkpoint(args.root, tag=args.tag)
        train(again, state["next_step"], args.after, order)
        out.update({f"{order}/{k}": v for k, v in snapshot(again).items()})
        again.close()


def fail(engine, args) -> None:
    try:
        engine.load_checkpoint(args.root, tag=args.tag)
        message = "no error"
    except zerompi.CheckpointError as e:
        message = f"CheckpointError: {e}"
    except Exception as e:  # noqa: BLE001 - any other type is a failure the test reports
        message = f"OTHER {type(e).__name__}: {e}"
    messages = COMM.allgather(message)
    if COMM.Get_rank() == 0:
        write_json(args.out, messages)
    if args.then_load:  # the failed load changed nothing: the previous checkpoint still loads here
        engine.load_checkpoint(args.root, tag=args.then_load)
        loaded = {f"saved/{k}": v for k, v in snapshot(engine).items()}
        if COMM.Get_rank() == 0:
            np.savez(args.then_out, **loaded)


def run(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if args.offload != "none" and COMM.Get_rank() == 0:
        import os
        os.makedirs(args.root + "-swap", exist_ok=True)
    COMM.Barrier()
    engine = zerompi.initialize(tiny_gpt(args.model_seed, n_embd=args.n_embd), config(args))
    if args.mode == "save" and args.fail_write_rank is not None:
        failing_async_save(engine, args)
        return
    if args.mode == "fail":
        fail(engine, args)
        engine.close()
        return
    out: dict[str, np.ndarray] = {}
    (save if args.mode == "save" else resume)(engine, args, out)
    out.update({f"final/{k}": v for k, v in snapshot(engine).items()})
    engine.close()
    if COMM.Get_rank() == 0:
        np.savez(args.out, **out)


if __name__ == "__main__":
    cases.main(run)
