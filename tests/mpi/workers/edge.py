"""Edge-case worker: awkward models and misuse, at every stage, on this world size.

Parity cases (against the single-process reference, fp32 unless named):
unused parameters, frozen parameters, a module called twice, activation
checkpointing, optimizer param groups, a custom optimizer class, fp16 with
dynamic loss scaling. Then fp16 overflow on one rank only (every rank must
skip together), and misuse that must raise the same zerompi error on every
rank instead of hanging. Rank 0 writes one JSON row per (case, stage).
"""
import argparse

import torch
from mpi4py import MPI
from torch import nn

import zerompi
from common import (MICRO, compare, gpt_loss, initial_params, references, rel_to_update, tiny_gpt, token_batches,
                    write_json, zero_train)

COMM = MPI.COMM_WORLD
WORLD, RANK = COMM.Get_size(), COMM.Get_rank()
SGD = dict(optimizer="sgd", lr=0.2, momentum=0.9, weight_decay=0.01)


class Mlp(nn.Module):
    """fc1 -> gelu -> (shared twice?) -> fc2, with a spare layer that forward may skip."""

    def __init__(self, twice: bool = False):
        super().__init__()
        torch.manual_seed(3)
        self.fc1, self.mid, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.spare = nn.Linear(8, 8)  # never called: its gradient is zero, as DDP would make it
        self.twice = twice

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.fc1(x))
        h = self.mid(h)
        if self.twice:
            h = self.mid(torch.tanh(h))  # same module, second call: gathered again, grads summed
        return ((self.fc2(h) - y) ** 2).mean()


def mlp_loss(model, batch):
    return model(*batch)


def mlp_batches(steps: int, accum: int = 1):
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(WORLD * MICRO, 6, generator=g), torch.randn(WORLD * MICRO, 4, generator=g))
             for _ in range(accum)] for _ in range(steps)]


def decay_groups(model):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def parity_case(stage, make, loss_fn, batches, cfg_kw, ref_make=None, param_groups=None):
    cfg = zerompi.ZeroConfig(stage=stage, bucket_mb=0.0005, **cfg_kw)
    model = make()
    init = initial_params(model)
    ours, engine = zero_train(model, cfg, batches, loss_fn, param_groups=param_groups)
    engine.close()
    ref, alts = references(COMM, ref_make or make, cfg, batches, loss_fn=loss_fn, param_groups=param_groups)
    if RANK != 0:
        return {}
    return dict(dtype=cfg.dtype, **compare(ours, ref, alts, init),
                moved=rel_to_update(ref.params, init, {n: 0 * t for n, t in init.items()}))


def frozen_mlp():
    m = Mlp()
    m.fc1.requires_grad_(False)
    return m


def overflow_case(stage):
    """fp16: rank N-1's loss becomes inf at step 1; every rank must skip that step together."""
    # 2**8: small enough that only the injected inf overflows
    cfg = zerompi.ZeroConfig(stage=stage, dtype="fp16", bucket_mb=0.0005, initial_scale_power=8, **SGD)
    engine = zerompi.initialize(Mlp(), cfg)
    batches = mlp_batches(3)
    snapshots = []
    for step, micro in enumerate(batches):
        x, y = (t[RANK * MICRO:(RANK + 1) * MICRO] for t in micro[0])
        loss = engine(x, y)
        if step == 1 and RANK == WORLD - 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        snapshots.append(engine.full_state_dict())
    unchanged = all(torch.equal(snapshots[0][n], snapshots[1][n]) for n in snapshots[0])
    changed_after = any(not torch.equal(snapshots[1][n], snapshots[2][n]) for n in snapshots[0])
    s = engine.stats
    engine.close()
    rows = COMM.allgather((s.skipped_steps, s.steps, s.loss_scale))
    return dict(skipped=[r[0] for r in rows], steps=[r[1] for r in rows], scales=[r[2] for r in rows],
                unchanged=unchanged, changed_after=changed_after)


def error_of(fn) -> str:
    try:
        fn()
    except zerompi.ZeroMPIError as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - the test reports any other type as a failure
        return f"OTHER {type(e).__name__}: {e}"
    return "no error"


def misuse_cases(stage):
    cfg = zerompi.ZeroConfig(stage=stage, bucket_mb=0.0005, **SGD)

    def step_first():
        zerompi.initialize(Mlp(), cfg).step()

    def backward_twice():
        engine = zerompi.initialize(Mlp(), cfg)
        x, y = torch.randn(MICRO, 6), torch.randn(MICRO, 4)
        engine.backward(engine(x, y))
        engine.backward(engine(x, y))

    def mismatched():
        model = Mlp()
        if RANK == WORLD - 1:
            model.fc2 = nn.Linear(8, 5)  # one rank built a different model
        zerompi.initialize(model, cfg)

    cases = dict(step_first=step_first, backward_twice=backward_twice,
                 no_params=lambda: zerompi.initialize(nn.ReLU(), cfg),
                 bad_dtype=lambda: zerompi.ZeroConfig(stage=stage, dtype="fp8"))
    if WORLD > 1:
        cases["mismatched"] = mismatched
    return {name: COMM.allgather(error_of(fn)) for name, fn in cases.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    gpt_batches = token_batches(5, WORLD, 3, 1)
    for stage in range(4):
        parity = {
            "unused": lambda: parity_case(stage, Mlp, mlp_loss, mlp_batches(3), SGD),
            "frozen": lambda: parity_case(stage, frozen_mlp, mlp_loss, mlp_batches(3), SGD),
            "called_twice": lambda: parity_case(stage, lambda: Mlp(twice=True), mlp_loss,
                                                mlp_batches(3, accum=2), {**SGD, "grad_accum_steps": 2}),
            "checkpointing": lambda: parity_case(stage, lambda: tiny_gpt(2, grad_checkpoint=True), gpt_loss,
                                                 gpt_batches, SGD, ref_make=lambda: tiny_gpt(2)),
            "param_groups": lambda: parity_case(stage, lambda: tiny_gpt(2), gpt_loss, gpt_batches,
                                                {**SGD, "weight_decay": 0.5},
                                                param_groups=decay_groups),
            "custom_optimizer": lambda: parity_case(stage, Mlp, mlp_loss, mlp_batches(3),
                                                    dict(optimizer=torch.optim.Adagrad, lr=0.05,
                                                         optimizer_kwargs={"lr_decay": 0.01})),
            "fp16": lambda: parity_case(stage, lambda: tiny_gpt(2), gpt_loss, gpt_batches,
                                        {**SGD, "dtype": "fp16"}),
        }
        for name, run in parity.items():
            rows.append(dict(case=name, stage=stage, world=WORLD, **run()))
        rows.append(dict(case="fp16_overflow", stage=stage, world=WORLD, **overflow_case(stage)))
        rows.append(dict(case="misuse", stage=stage, world=WORLD, errors=misuse_cases(stage)))
    if RANK == 0:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
