"""The parity matrix's combinations and the ZeRO paper's communication volumes,
shared by the tests that judge workers/parity.py's rows."""
from __future__ import annotations

import itertools

from .launcher import WorkerResults

# (stage, dtype, grad_accum_steps, clip_grad_norm, optimizer)
COMBOS = list(itertools.product(range(4), ("fp32", "bf16"), (1, 2), (None, 0.05), ("adamw", "sgd")))


# Every pair of values of two of (dtype, accumulation, clipping, optimizer) in some row, the four rows
# the byte counts are judged on (fp32/bf16 x accumulation 1/2, no clipping, AdamW) among them: for
# matrices whose subject is the communication pattern, not its interplay with every option.
PAIRWISE = [("fp32", 1, None, "adamw"), ("fp32", 2, None, "adamw"), ("bf16", 1, None, "adamw"),
            ("bf16", 2, None, "adamw"), ("fp32", 2, 0.05, "sgd"), ("bf16", 1, 0.05, "sgd"),
            ("fp32", 1, 0.05, "adamw"), ("bf16", 2, None, "sgd")]


def combos_arg(combos) -> str:
    """``combos`` as workers/parity.py's --combos argument."""
    return ",".join(f"{d}/{a}/{'-' if c is None else c}/{o}" for d, a, c, o in combos)


def combo_id(combo) -> str:
    stage, dtype, accum, clip, opt = combo
    return f"stage{stage}-{dtype}-accum{accum}-{'clip' if clip else 'noclip'}-{opt}"


def combo_key(row: dict) -> tuple:
    return row["stage"], row["dtype"], row["accum"], row["clip"], row["optimizer"]


def parity_results(tmp_path_factory) -> WorkerResults:
    """workers/parity.py, run once per (world, arguments) and indexed by combination."""
    return WorkerResults("parity.py", combo_key, tmp_path_factory)


def collective_bytes(row: dict) -> dict[str, int]:
    """The bytes a row sent in gradient and parameter collectives."""
    return {k: v for k, v in row["bytes_sent"].items() if k in ("all_reduce", "reduce_scatter", "all_gather")}


def zero_volume(r: dict) -> dict[str, int]:
    """Expected bytes per kind over the run: the ZeRO paper's Ψ-multiples, counted on padded buffers."""
    n, steps, accum = r["world"], r["steps"], r["accum"]
    itemsize = 4 if r["dtype"] == "fp32" else 2
    v = (n - 1) * r["padded"] // n * itemsize * steps  # one Ψ-sized collective, per step
    expected = {0: {"all_reduce": 2 * v},
                1: {"reduce_scatter": v, "all_gather": v},
                2: {"reduce_scatter": accum * v, "all_gather": v},
                3: {"all_gather": 2 * accum * v, "reduce_scatter": accum * v}}[r["stage"]]
    sent = collective_bytes(r)
    return {k: b for k, b in expected.items() if b or k in sent}
