"""Linear regression y = Xw + b + noise by ZeRO data-parallel gradient descent over MPI.

    mpiexec -n 2 python -m mpi4py jobs/linear_regression.py \
        [--config jobs/configs/linear_regression.toml] [--stage 0-3] [--steps N] [--out DIR]

The data are drawn from a fixed seed: n_train + n_test points with standard normal
features, true weights and bias, and Gaussian noise. Each step, each rank takes its
shard of the global batch (batch = 0: the whole training set, i.e. full-batch
gradient descent) and the engine averages the mean-squared-error gradients. At the
end rank 0 prints the learned w and b beside the closed-form least-squares solution
of the same training set (float64) and the distance between them, and whether it is
within train.tolerance.
"""
from __future__ import annotations

import torch
from torch import nn

import zerompi
from common import (LOOP_DEFAULTS, Preemption, apply_flags, job_main, load_config, parse_args, setup_logging,
                    shard_indices, share, start_run, test_metrics, train_loop)

TRAIN_DEFAULTS = dict(LOOP_DEFAULTS, batch=0, out_dir="out/linear-regression", tolerance=1e-4)
DATA_DEFAULTS = dict(features=16, n_train=2048, n_test=512, noise=0.1, data_seed=0)


def make_data(features: int, n_train: int, n_test: int, noise: float, data_seed: int):
    """(x_train, y_train, x_test, y_test, w_true, b_true), the same on every rank."""
    g = torch.Generator().manual_seed(data_seed)
    w = torch.randn(features, generator=g)
    b = torch.randn((), generator=g)
    x = torch.randn(n_train + n_test, features, generator=g)
    y = x @ w + b + noise * torch.randn(n_train + n_test, generator=g)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:], w, b


def least_squares(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The closed-form solution [w; b] minimising ||[x 1] [w; b] - y||², in float64."""
    a = torch.cat([x, torch.ones(len(x), 1)], dim=1).double()
    return torch.linalg.lstsq(a, y.double()[:, None]).solution[:, 0]


def report(learned: torch.Tensor, exact: torch.Tensor, true: torch.Tensor, tolerance: float) -> None:
    print(f"{'':>6} {'learned':>10} {'least sq.':>10} {'true':>10}")
    names = [f"w[{i}]" for i in range(len(learned) - 1)] + ["b"]
    for name, a, e, t in zip(names, learned.tolist(), exact.tolist(), true.tolist()):
        print(f"{name:>6} {a:10.5f} {e:10.5f} {t:10.5f}")
    distance = float(torch.linalg.vector_norm(learned.double() - exact))
    verdict = "converged" if distance <= tolerance else "NOT converged"
    print(f"distance to the least-squares solution {distance:.2e} (tolerance {tolerance:.0e}): {verdict}",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, "jobs/configs/linear_regression.toml", argv)
    preemption = Preemption()
    rank0 = setup_logging()
    data_doc, train, zero_doc = load_config(args.config, TRAIN_DEFAULTS)
    cfg = apply_flags(args, train, zero_doc)
    data = dict(DATA_DEFAULTS, **data_doc)
    x, y, x_test, y_test, w_true, b_true = make_data(**data)

    torch.manual_seed(train["seed"])
    model = nn.Linear(data["features"], 1)
    engine = zerompi.initialize(model, cfg)
    world, rank = engine.world_size, engine.rank
    batch = train["batch"] or len(x)
    run = start_run(engine, train, {"model": data}, args.resume, "samples", batch, preemption)

    def mse(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(engine(xs)[:, 0], ys)

    def step_fn(step: int) -> dict:
        idx = shard_indices(len(x), batch, step, train["seed"], rank, world)
        loss = mse(x[idx], y[idx]) * share(len(idx), batch, world)  # the global batch's mean, also uneven
        engine.backward(loss)
        engine.step()
        return {"loss": loss.item()}

    def eval_fn() -> dict:
        with torch.no_grad():  # each rank its share of the test set
            return test_metrics(engine, len(y_test[rank::world]), mse(x_test[rank::world], y_test[rank::world]).item())

    result = train_loop(run, step_fn, eval_fn)
    if result.completed:
        full = engine.full_state_dict()  # collective
        if rank0:
            learned = torch.cat([full["weight"][0], full["bias"]])
            report(learned, least_squares(x, y), torch.cat([w_true, b_true[None]]), train["tolerance"])


if __name__ == "__main__":
    job_main(main)
