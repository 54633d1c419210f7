"""results/cluster.md from results/cluster.jsonl (benchmarks/bench_cluster.py): the table, the model, its
check on points it was not fitted on, and the projection to 64 and 1,024 ranks.

The model. A row's step time on links of rate beta (bits/s, tbf's rate) is

    t = t0 + k * W,        W = 8 X / beta

X is the bytes per step out of the busiest node, from its link counter, and W the seconds the link needs
for them. t0 is everything else (compute, intra-node traffic, latency); k says how much of the wire time
the step waits for (1: all of it, nothing overlapped; above 1: the shaped link is used below its rate).
One k for all rows is fitted on the 2-node runs, from the difference between the two link rates (t0
cancels: t(b1) - t(b2) = k (W1 - W2)); the 4-node runs check it: their slow-link time is predicted
from their fast-link time and X. Bytes per node grow with the node count R as (R-1)/R does for every
hierarchy here when each block goes straight to the rank that needs it (the README's formula, [Node-aware
groups] in docs/clusters.md); a ring over all ranks carries (N-1)/N of a buffer through each node
instead. The 4-node bytes check which one the MPI library's algorithms follow.

The projection to N = 64 and 1,024 ranks (s ranks a node as measured, R = N / s nodes) scales the
2-node bytes by that growth, adds k W at 1 and 10 Gbit/s, and a latency term the runs cannot fit
(one latency was measured): alpha (N - 1) per ring collective, times the row's collectives per step,
alpha the one-way latency of a 1-byte MPI message between two nodes, measured by every launch (median).
t0 comes from the 2-node fit with the cores' oversubscription taken out (4 ranks shared 2 cores: t0 / 2),
for a node whose ranks compute on cores of their own.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

LABELS = {
    "z0-flat": "zerompi stage 0", "ddp": "DDP", "fsdp2": "FSDP2 fully_shard (flat)",
    "fsdp2-hsdp": "FSDP2 HSDP (2-D mesh)", "ds3": "DeepSpeed ZeRO-3", "ds3-hpz": "DeepSpeed ZeRO++ hpZ",
    "ds3-qwz-qgz": "DeepSpeed ZeRO++ qwZ + qgZ",
}


def label(row: str) -> str:
    if row in LABELS:
        return LABELS[row]
    stage, hierarchy, *q = row[1:].split("-")
    return f"zerompi stage {stage} {hierarchy}" + (" int8 w+g" if q else "")


def load(path: Path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    lines = [x for x in lines if x.get("kind") == "row"]
    last = max((x["run"] for x in lines), default=None)
    return [x for x in lines if x["run"] == last]


def fold(lines: list[dict]) -> dict:
    """(nodes, mbit, row) -> step times over rounds, bytes out of the busiest node (median), errors."""
    cells = defaultdict(lambda: dict(times=[], tx=[], rx=[], errors=[], calls=None))
    for x in lines:
        c = cells[(x["nodes"], x["mbit"], x["row"])]
        if x.get("error"):
            c["errors"].append(x["error"])
            continue
        c["times"].append(x["step_s"])
        c["tx"].append(max(x["link_tx"].values()))
        c["rx"].append(max(x["link_rx"].values()))
        c["calls"] = x.get("collectives_per_step")
    return cells


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return ""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def fit(cells: dict, nodes: int, mbits: list[int]) -> tuple[float | None, list]:
    """k from the two rates' differences at ``nodes`` (least squares through the origin)."""
    lo, hi = min(mbits), max(mbits)
    pts = []
    for (n, m, row), c in cells.items():
        other = cells.get((n, hi, row))
        if n != nodes or m != lo or not c["times"] or not other or not other["times"]:
            continue
        dw = 8 * statistics.median(c["tx"]) / (lo * 1e6) - 8 * statistics.median(other["tx"]) / (hi * 1e6)
        dt = statistics.median(c["times"]) - statistics.median(other["times"])
        pts.append((row, dw, dt))
    den = sum(dw * dw for _, dw, _ in pts)
    return (sum(dw * dt for _, dw, dt in pts) / den if den else None), pts


def write(src: Path, dst: Path) -> Path:
    lines = load(src)
    if not lines:
        dst.write_text("# Speed across node links\n\nNo run recorded yet: `benchmarks/bench_cluster.py`.\n")
        return dst
    cells = fold(lines)
    first = lines[0]
    nodes_all = sorted({x["nodes"] for x in lines})
    mbits = sorted({x["mbit"] for x in lines})
    rows_all = list(dict.fromkeys(x["row"] for x in lines))
    rounds = len({x["round"] for x in lines})
    out = ["# Speed across node links (jobs/cluster/up.sh's nodes)", "",
           f"`benchmarks/bench_cluster.py` at commit {first['commit'][:7]}, {first['run']}, "
           f"{first.get('machine', {}).get('cpus', '?')} CPUs shared by every node; {rounds} rounds, "
           f"families interleaved; GPT {first['size']} ({first['steps']} timed steps, 1 sequence of 256 a rank), "
           f"{first['per_node']} ranks a node, links shaped to the rate shown by tbf, "
           + (f"netem delay {first['latency_us']} us, " if first.get("latency_us") else "no delay added, ")
           + f"MPI's 1-byte one-way latency between nodes {1e6 * alpha(lines):.0f} us (median over launches).",
           "Step time: median over rounds of the median slowest-rank step (min-max over rounds). "
           "Bytes: out of the busiest node per step, its eth0 counter (MB, 1e6).", ""]
    for n in nodes_all:
        head = ["row"] + [f"{m / 1000:g} Gbit/s: s/step" for m in mbits] + ["MB out / in a node per step"]
        out += [f"## {n} nodes x {first['per_node']} ranks", "", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head)]
        for row in rows_all:
            cs = [cells.get((n, m, row)) for m in mbits]
            if not any(cs):
                continue
            steps = [spread(c["times"]) or ("failed: " + c["errors"][0][:80] if c["errors"] else "")
                     for c in cs]
            c0 = next((c for c in cs if c and c["tx"]), None)
            mb = f"{statistics.median(c0['tx']) / 1e6:.2f} / {statistics.median(c0['rx']) / 1e6:.2f}" if c0 else ""
            out.append(f"| {label(row)} | " + " | ".join(steps) + f" | {mb} |")
        out.append("")
    out += model_section(cells, nodes_all, mbits, first, lines)
    dst.write_text("\n".join(out) + "\n")
    return dst


def model_section(cells: dict, nodes_all: list[int], mbits: list[int], first: dict,
                  lines: list[dict]) -> list[str]:
    if len(mbits) < 2 or len(nodes_all) < 1:
        return ["## Model", "", "Two link rates are needed to fit it.", ""]
    n_fit = nodes_all[0]
    k, pts = fit(cells, n_fit, mbits)
    if k is None:
        return ["## Model", "", "No row ran at both rates.", ""]
    lo, hi = min(mbits), max(mbits)
    out = ["## Model: t = t0 + k W, W = 8 X / beta (the module docstring says why)", "",
           f"Fitted on the {n_fit}-node rows ({len(pts)} rows, both rates): **k = {k:.2f}** "
           "(the step waits for this multiple of the wire time its bytes need).", ""]
    for n in nodes_all[1:]:
        out += [f"### Check on the {n}-node runs (not fitted): the {lo / 1000:g} Gbit/s time predicted "
                f"from the {hi / 1000:g} Gbit/s time", "",
                "| row | measured s | predicted s | error | bytes measured / predicted from 2 nodes |",
                "|---|---|---|---|---|"]
        errs = []
        for (nn, m, row), c in cells.items():
            fast = cells.get((nn, hi, row))
            base = cells.get((n_fit, lo, row))
            if nn != n or m != lo or not c["times"] or not fast or not fast["times"]:
                continue
            x_lo, x_hi = statistics.median(c["tx"]), statistics.median(fast["tx"])
            pred = statistics.median(fast["times"]) + k * (8 * x_lo / (lo * 1e6) - 8 * x_hi / (hi * 1e6))
            meas = statistics.median(c["times"])
            errs.append(abs(pred - meas) / meas)
            grow = ((n - 1) / n) / ((n_fit - 1) / n_fit)
            xb = f"{x_lo / 1e6:.2f} / {statistics.median(base['tx']) * grow / 1e6:.2f}" if base and base["tx"] else ""
            out.append(f"| {label(row)} | {meas:.3f} | {pred:.3f} | {100 * (pred - meas) / meas:+.0f} % | {xb} |")
        if errs:
            out += ["", f"Median absolute error {100 * statistics.median(errs):.0f} %, largest "
                    f"{100 * max(errs):.0f} %.", ""]
    out += projection(cells, n_fit, lo, hi, k, first, lines)
    return out


def alpha(lines: list[dict]) -> float:
    """The median one-way latency the launches measured (seconds)."""
    return statistics.median([x["alpha_s"] for x in lines if x.get("alpha_s")] or [0.0])


def projection(cells: dict, n_fit: int, lo: int, hi: int, k: float, first: dict, lines: list[dict]) -> list[str]:
    s = first["per_node"]
    cpus = first.get("machine", {}).get("cpus") or 2
    a = alpha(lines)
    over = max(1.0, n_fit * s / cpus)
    out = [f"## Projection to 64 and 1,024 ranks ({s} a node), this model, zerompi rows", "",
           f"t0 from the {n_fit}-node fit divided by {over:g} (its ranks shared {cpus} cores); bytes out of a node "
           f"scaled from {n_fit} nodes by (R-1)/R; latency alpha (N-1) a collective, alpha = "
           f"{1e6 * a:.0f} us (measured), times the row's collectives per step.", "",
           "| row | N | MB out a node | s/step at 1 Gbit/s | s/step at 10 Gbit/s | of which latency |",
           "|---|---|---|---|---|---|"]
    for (n, m, row), c in sorted(cells.items(), key=lambda kv: kv[0][2]):
        fast = cells.get((n, hi, row))
        if n != n_fit or m != lo or not row.startswith("z") or not c["times"] or not fast or not fast["times"]:
            continue
        x_fast = statistics.median(fast["tx"])
        t0 = (statistics.median(fast["times"]) - k * 8 * x_fast / (hi * 1e6)) / over
        for ranks in (64, 1024):
            r_nodes = ranks // s
            x = statistics.median(c["tx"]) * ((r_nodes - 1) / r_nodes) / ((n_fit - 1) / n_fit)
            lat = a * (ranks - 1) * (c["calls"] or 0)
            t = [t0 + k * 8 * x / (g * 1e9) + lat for g in (1, 10)]
            out.append(f"| {label(row)} | {ranks} | {x / 1e6:.2f} | {t[0]:.3f} | {t[1]:.3f} | {lat:.3f} |")
    return out + [""]
