"""The markdown report of a bench_peers.py run: header, one table per size x world size, targets."""
from __future__ import annotations

import re
from collections import defaultdict

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
    return r if r is not None and r["status"] == "ok" else None


def header(meta: dict) -> str:
    s, v = meta["settings"], meta["versions"]
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
        + ("; MPICH ranks yield while waiting" if s["mpich_yield"] else ""),
        f"- load average (1, 5, 15 min) at start {_la(la0)}, at end {_la(la1)}: other work on the machine "
        "shows here and in each row's min-max.",
        "",
    ])


def _la(la) -> str:
    return "/".join(f"{x:.2f}" for x in la)


def short_error(r: dict) -> str:
    """The first line of a failed row's error (exit code or timeout) and its exception, if one shows."""
    lines = r.get("error", "").splitlines() or ["?"]
    raised = [ln.strip() for ln in lines[1:] if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", ln.strip())]
    return (lines[0] + (f": {raised[-1]}" if raised else "")).replace("|", "/")[:200]


def _cells(r: dict, ddp: dict | None) -> list[str]:
    if r["status"] != "ok":
        return [r["label"], f"{r['status'].upper()}: {short_error(r)}"]
    comm = r["bytes_per_step"]
    ratio = f"{r['step_s_median'] / ddp['step_s_median']:.2f}" if ddp else "-"
    dloss = f"{r['loss_final'] - ddp['loss_final']:+.1e}" if ddp else "-"
    star = "*" if r.get("implicit_bytes_per_step") else ""
    return [r["label"], f"{r['step_s_median']:.2f}", ratio, f"{r['step_s_min']:.2f}-{r['step_s_max']:.2f}",
            f"{r['rss_peak_max'] / MiB:.0f}", f"{r['rss_steady_max'] / MiB:.0f}",
            f"{comm / 1e6:.1f}{star}", f"{comm / ideal_bytes(r):.2f}", f"{r['loss_final']:.5f}", dloss]


COLUMNS = ["row", "step s (median)", "x DDP", "min-max s", "peak RSS MiB/rank", "steady RSS MiB/rank",
           "comm MB/step/rank", "x ideal", "final loss", "loss - DDP"]


def table(rows: dict[str, dict]) -> list[str]:
    ddp = _ok(rows, "ddp")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows.values():
        cells = _cells(r, ddp)
        lines.append("| " + " | ".join(cells + [""] * (len(COLUMNS) - len(cells))) + " |")
    return lines


def loss_lines(rows: dict[str, dict]) -> list[str]:
    ok = [r for r in rows.values() if r["status"] == "ok"]
    if len(ok) < 2:
        return []
    first = [r["loss_first"] for r in ok]
    final = [r["loss_final"] for r in ok]
    spread = max(final) - min(final)
    verdict = "agree" if spread <= LOSS_TOLERANCE else f"DISAGREE (tolerance {LOSS_TOLERANCE:g})"
    return [f"Loss over {len(ok)} rows: first step spread {max(first) - min(first):.1e} (same weights, same "
            f"data), final step spread {spread:.1e}: {verdict}."]


def _verdict(value: float, target: float, what: str) -> str:
    if value <= target:
        return f"met: {what} {value:.2f} (target <= {target:.2f})"
    return f"MISSED by {100 * (value / target - 1):.0f}%: {what} {value:.2f} (target <= {target:.2f})"


def target_lines(rows: dict[str, dict]) -> list[str]:
    ddp, fsdp, ds3, z3 = (_ok(rows, k) for k in ("ddp", "fsdp2", "ds-3", "zerompi-3"))
    out = []
    for stage in (1, 2):
        z = _ok(rows, f"zerompi-{stage}")
        if z and ddp:
            out.append(f"stage {stage} step time: " + _verdict(z["step_s_median"] / ddp["step_s_median"], 1.0,
                                                               "x DDP"))
    if z3 and fsdp:
        out.append("stage 3 step time: " + _verdict(z3["step_s_median"] / fsdp["step_s_median"], 0.9,
                                                    "x FSDP2 (reshard after forward)"))
    if z3 and ds3:
        out.append("stage 3 step time: " + _verdict(z3["step_s_median"] / ds3["step_s_median"], 1.0,
                                                    "x DeepSpeed ZeRO-3"))
        for kind in ("steady", "peak"):
            out.append(f"stage 3 {kind} RSS per rank: " + _verdict(
                z3[f"rss_{kind}_max"] / ds3[f"rss_{kind}_max"], 1.0, "x DeepSpeed ZeRO-3"))
    return ["Targets:", ""] + [f"- {line}" for line in out] if out else ["Targets: not measured (rows missing)."]


def auto_reading(cases: dict) -> list[str]:
    lines = []
    for (size, np_), rows in cases.items():
        ok = [r for r in rows.values() if r["status"] == "ok"]
        failed = [r["label"] for r in rows.values() if r["status"] != "ok"]
        if not ok:
            continue
        fast = min(ok, key=lambda r: r["step_s_median"])
        small = min(ok, key=lambda r: r["rss_steady_max"])
        noise = max(r["step_s_max"] / r["step_s_min"] - 1 for r in ok)
        lines.append(f"- {size}, {np_} ranks: fastest {fast['label']} ({fast['step_s_median']:.2f} s), "
                     f"smallest steady RSS {small['label']} ({small['rss_steady_max'] / MiB:.0f} MiB); "
                     f"step times varied up to {100 * noise:.0f}% within a row"
                     + (f"; failed: {', '.join(failed)}" if failed else "") + ".")
    return lines


def markdown(meta: dict, results: list[dict], reading: str | None = None) -> str:
    cases = _by_case(results)
    parts = [header(meta)]
    for (size, np_), rows in cases.items():
        some = next((r for r in rows.values() if r["status"] == "ok"), None)
        params = f", {some['params'] / 1e6:.2f}M parameters" if some else ""
        parts += [f"## {size}, {np_} ranks{params}", "", *table(rows), "", *loss_lines(rows), "",
                  *target_lines(rows), ""]
    parts += ["## Reading", "", *(reading.strip().splitlines() if reading else auto_reading(cases)), ""]
    parts += ["Columns: step time is the median over the timed steps of the slowest rank's time (ranks "
              "start each step together); x DDP divides by the DDP row's; peak RSS is `ru_maxrss` and "
              "steady RSS the resident size after the last step, both the largest over ranks; comm is "
              "what one rank sends per step, counted like zerompi's `engine.stats.bytes_sent` "
              "(all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the full tensor), "
              "* = DDP's all-reduce taken from its algorithm; x ideal divides by (N-1)/N x {2, 3} x "
              "params x 4 bytes (3 for ZeRO-3 sharding, else 2). See benchmarks/README.md.", ""]
    return "\n".join(parts)
