"""The markdown report of a bench_peers.py run: header, one table per size x world size, targets.

The rows' repeats are folded first (harness/summary.py): step time is the median over repeats of each
repeat's median step, with the spread (min-max) of those, and ratios carry the range the two
rows' spreads allow; a ratio whose range contains 1.0 is "at parity".
"""
from __future__ import annotations

from collections import defaultdict

from harness import summary as rp
from harness.markdown import load as _la
from harness.markdown import short_error

MiB = 2**20
LOSS_TOLERANCE = 1e-3


def _by_case(results: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    cases: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for r in results:
        cases[(r["size"], r["np"])][r["row"]] = r
    return cases


def ideal_bytes(r: dict) -> float:
    """(N-1)/N x {2, 3} x params x 4 bytes: the ZeRO paper's volume for this row's sharding."""
    n = r["np"]
    return r["ideal_psi"] * (n - 1) / n * r["params"] * 4


def _ok(rows: dict[str, dict], key: str) -> dict | None:
    r = rows.get(key)
    return r if r is not None and r["status"] == "ok" and r.get("repeats_ok", 1) > 0 else None


def header(meta: dict) -> str:
    s, v = meta["settings"], meta["versions"]
    reps = s.get("repeats", 1)
    la0, la1 = meta["loadavg_start"], meta.get("loadavg_end", meta["loadavg_start"])
    return "\n".join([
        "# zerompi beside its peers",
        "",
        f"- date: {meta['date']}; host {meta['host']}: {meta['cpu']}, {meta['cores']} cores, "
        f"{meta['mem_bytes'] / 2**30:.0f} GiB; {meta['os']}",
        f"- versions: Python {meta['python']}, " + ", ".join(f"{k} {val}" for k, val in v.items() if val)
        + f"; {meta['mpi']}; zerompi commit {meta['zerompi_commit']}",
        f"- settings: sequence {s['seq']}, micro-batch {s['micro_batch']} per rank, {s['dtype']} AdamW "
        f"lr {s['lr']} wd {s['weight_decay']}, {s['threads_per_rank']} torch thread per rank, "
        f"bucket {s['bucket_mb']} MB, seed {s['seed']}; {s['warmup']} warm-up + {s['steps']} timed steps"
        + (f" per repeat, {reps} interleaved repeats (repeat 1 of every row, then repeat 2, ...; each "
           "repeat its own mpiexec job)" if reps > 1 else "")
        + ("; MPICH ranks yield while waiting" if s["mpich_yield"] else ""),
        f"- load average (1, 5, 15 min) at start {_la(la0)}, at end {_la(la1)}: other work on the machine "
        "shows here and in each row's spread.",
        "",
    ])


def _cells(r: dict, ddp: dict | None) -> list[str]:
    if r.get("repeats_ok", 1) == 0 or r["status"] != "ok":
        return [r["label"], f"{r['status'].upper()}: {short_error(r)}"]
    comm = r["bytes_per_step"]
    ratio = rp.fmt_ratio(rp.ratio(r, ddp)) if ddp and r is not ddp else ("1.00" if ddp else "-")
    dloss = f"{r['loss_final'] - ddp['loss_final']:+.1e}" if ddp else "-"
    star = "*" if r.get("implicit_bytes_per_step") else ""
    n_rep = f"{r['repeats_ok']}" + (f" of {r['repeats']}" if r["repeats_ok"] < r["repeats"] else "")
    return [r["label"], f"{r['step_s_median']:.2f}", f"{r['step_s_lo']:.2f}-{r['step_s_hi']:.2f}", n_rep, ratio,
            f"{r['step_s_min']:.2f}-{r['step_s_max']:.2f}",
            f"{r['rss_peak_max'] / MiB:.0f}", f"{r['rss_steady_max'] / MiB:.0f}",
            f"{comm / 1e6:.1f}{star}", f"{comm / ideal_bytes(r):.2f}", f"{r['loss_final']:.5f}", dloss]


COLUMNS = ["row", "step s (median of repeats)", "spread s", "repeats", "x DDP (range, verdict)",
           "single steps min-max s", "peak RSS MiB/rank", "steady RSS MiB/rank", "comm MB/step/rank", "x ideal",
           "final loss", "loss - DDP"]


def table(rows: dict[str, dict]) -> list[str]:
    ddp = _ok(rows, "ddp")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows.values():
        cells = _cells(r, ddp)
        lines.append("| " + " | ".join(cells + [""] * (len(COLUMNS) - len(cells))) + " |")
    return lines


def loss_lines(rows: dict[str, dict]) -> list[str]:
    ok = [r for r in rows.values() if _ok(rows, r["row"])]
    if len(ok) < 2:
        return []
    first = [r["loss_first"] for r in ok]
    final = [r["loss_final"] for r in ok]
    spread = max(final) - min(final)
    verdict = "agree" if spread <= LOSS_TOLERANCE else f"DISAGREE (tolerance {LOSS_TOLERANCE:g})"
    over_repeats = max(r.get("loss_final_spread", 0.0) for r in ok)
    return [f"Loss over {len(ok)} rows: first step spread {max(first) - min(first):.1e} (same weights, same "
            f"data), final step spread {spread:.1e}: {verdict}; largest spread of a row's final loss over its "
            f"repeats {over_repeats:.1e}."]


# The comparisons the README's speed table reports: (label, row, reference row, what is compared).
COMPARISONS = [
    ("stage 1 / DDP", "zerompi-1", "ddp", "step_s"),
    ("stage 2 / DDP", "zerompi-2", "ddp", "step_s"),
    ("stage 3 / FSDP2", "zerompi-3", "fsdp2", "step_s"),
    ("stage 3 / DeepSpeed ZeRO-3", "zerompi-3", "ds-3", "step_s"),
    ("stage 3 steady RSS / DeepSpeed ZeRO-3", "zerompi-3", "ds-3", "rss_steady_max"),
    ("stage 3 peak RSS / DeepSpeed ZeRO-3", "zerompi-3", "ds-3", "rss_peak_max"),
]
# Targets: (comparison label, target ratio).
TARGETS = {"stage 1 / DDP": 1.0, "stage 2 / DDP": 1.0, "stage 3 / FSDP2": 0.9, "stage 3 / DeepSpeed ZeRO-3": 1.0,
           "stage 3 steady RSS / DeepSpeed ZeRO-3": 1.0, "stage 3 peak RSS / DeepSpeed ZeRO-3": 1.0}


def comparisons(rows: dict[str, dict]) -> list[tuple[str, dict]]:
    """(label, ratio) for each comparison whose two rows were measured."""
    out = []
    for label, key, ref, what in COMPARISONS:
        a, b = _ok(rows, key), _ok(rows, ref)
        if a and b:
            out.append((label, rp.ratio(a, b, what)))
    return out


def target_lines(rows: dict[str, dict]) -> list[str]:
    out = []
    for label, r in comparisons(rows):
        target = TARGETS[label]
        out.append(f"{label}: {rp.target_verdict(r, target)}: {rp.fmt_ratio(r)} (target <= {target:.2f})")
    return ["Targets (met: the whole range is at or under the target):", ""] + [f"- {line}" for line in out] \
        if out else ["Targets: not measured (rows missing)."]


def comparison_table(cases: dict) -> list[str]:
    """The README's speed table: one line per comparison, one column per size x world size."""
    keys = list(cases)
    cells = {k: dict(comparisons(rows)) for k, rows in cases.items()}
    labels = [c[0] for c in COMPARISONS if any(c[0] in cells[k] for k in keys)]
    if not labels:
        return []
    lines = ["## Ratios (median of repeats, range from the two rows' spreads, verdict)", "",
             "| | " + " | ".join(f"{size}, {np_} ranks" for size, np_ in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(rp.fmt_ratio(cells[k][label]) if label in cells[k] else "-"
                                                  for k in keys) + " |")
    return lines + ["", "A range that contains 1.00 is \"at parity\": the two rows differ by less than their "
                        "repeats do.", ""]


def auto_reading(cases: dict) -> list[str]:
    lines = []
    for (size, np_), rows in cases.items():
        ok = [r for r in rows.values() if _ok(rows, r["row"])]
        failed = [r["label"] for r in rows.values() if not _ok(rows, r["row"])]
        if not ok:
            continue
        fast = min(ok, key=lambda r: r["step_s_median"])
        small = min(ok, key=lambda r: r["rss_steady_max"])
        noise = max(r["step_s_hi"] / r["step_s_lo"] - 1 for r in ok)
        lines.append(f"- {size}, {np_} ranks: fastest {fast['label']} ({fast['step_s_median']:.2f} s), "
                     f"smallest steady RSS {small['label']} ({small['rss_steady_max'] / MiB:.0f} MiB); "
                     f"a row's repeats differed by up to {100 * noise:.0f}%"
                     + (f"; failed: {', '.join(failed)}" if failed else "") + ".")
    return lines


def failed_repeat_lines(results: list[dict]) -> list[str]:
    bad = [r for r in results if r.get("failed_repeats")]
    return (["Failed repeats (left out of the medians):", ""]
            + [f"- {r['size']}, {r['np']} ranks, {r['label']}, repeat {f['repeat']}: {f['status']}: "
               + short_error(f) for r in bad for f in r["failed_repeats"]] + [""]) if bad else []


def markdown(meta: dict, results: list[dict], reading: str | None = None) -> str:
    """The report of a run; ``results`` are the jsonl's per-repeat ``row`` records."""
    folded = rp.fold(results)
    cases = _by_case(folded)
    parts = [header(meta), *comparison_table(cases)]
    for (size, np_), rows in cases.items():
        some = next((r for r in rows.values() if _ok(rows, r["row"])), None)
        params = f", {some['params'] / 1e6:.2f}M parameters" if some else ""
        parts += [f"## {size}, {np_} ranks{params}", "", *table(rows), "", *loss_lines(rows), "",
                  *target_lines(rows), ""]
    parts += failed_repeat_lines(folded)
    parts += ["## Reading", "", *(reading.strip().splitlines() if reading else auto_reading(cases)), ""]
    parts += ["Columns: a repeat's step time is the median over its timed steps of the slowest rank's time "
              "(ranks start each step together); the row's is the median over repeats, spread the min-max of "
              "the repeats' step times, single steps min-max the fastest and slowest single step of any "
              "repeat; x DDP divides by the DDP row's median, with the range from the two spreads "
              "(fastest/slowest, slowest/fastest) and \"at parity\" where it contains 1.00; peak RSS is "
              "`ru_maxrss` and steady RSS the resident size after the last step, both the largest over ranks "
              "(median over repeats); comm is "
              "what one rank sends per step, counted like zerompi's `engine.stats.bytes_sent` "
              "(all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the full tensor), "
              "* = DDP's all-reduce taken from its algorithm; x ideal divides by (N-1)/N x {2, 3} x "
              "params x 4 bytes (3 for ZeRO-3 sharding, else 2). See benchmarks/README.md.", ""]
    return "\n".join(parts)
