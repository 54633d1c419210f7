"""The markdown report of bench_transport.py: each row's collectives per step, timed on MPICH shared
memory and on gloo over TCP loopback, and (with a bench_peers run beside it) how much of a step-time
gap between zerompi and a peer those transports account for."""
from __future__ import annotations

import statistics
from collections import defaultdict

from harness.markdown import load, short_error

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all")
SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC", "reduce": "R",
         "all_to_all": "A2A"}
TRANSPORTS = {"mpi": "MPICH shm", "gloo": "gloo TCP"}
GAPS = [("stage 1 / DDP", "zerompi-1", "ddp"), ("stage 2 / DDP", "zerompi-2", "ddp"),
        ("stage 3 / FSDP2", "zerompi-3", "fsdp2"), ("stage 3 / DeepSpeed ZeRO-3", "zerompi-3", "ds-3")]
LORA_GAPS = [("LoRA: stage 3 / DeepSpeed ZeRO-3 (defaults)", "stage3", "deepspeed-zero3")]  # bench_transport --lora


def fold_times(times: list[dict]) -> dict[tuple[int, str, str], dict]:
    """(np, row, transport) -> median over repeats of the per-repeat median, spread, op split."""
    per: dict[tuple, list[dict]] = defaultdict(list)
    for t in times:
        if t["status"] != "ok":
            continue
        for row, r in t["rows"].items():
            per[(t["np"], row, t["transport"])].append(r)
    out = {}
    for key, reps in per.items():
        med = [r["median"] for r in reps]
        ops = {op: statistics.median(r["op_s"].get(op, 0.0) for r in reps)
               for op in sorted({o for r in reps for o in r["op_s"]})}
        out[key] = dict(median=statistics.median(med), lo=min(med), hi=max(med), repeats=len(med),
                        per_repeat=med, op_s=ops)
    return out


def _s(x: dict) -> str:
    return f"{x['median']:.3f} ({x['lo']:.3f}-{x['hi']:.3f})" if x["repeats"] > 1 else f"{x['median']:.3f}"


def call_summary(calls: list[dict]) -> dict[str, tuple[int, float]]:
    """op -> (calls, MB of full tensors)."""
    out: dict[str, list] = {}
    for c in calls:
        s = out.setdefault(c["op"], [0, 0.0])
        s[0] += 1
        s[1] += c["numel"] * c["itemsize"] / 1e6
    return {op: (n, mb) for op, (n, mb) in out.items()}


def _sizes(calls: list[dict], op: str) -> str:
    """The distinct sizes of one op's calls, largest first: ``6 x 12.6 + 1 x 1.1 MB``."""
    count: dict[float, int] = defaultdict(int)
    for c in calls:
        if c["op"] == op:
            count[float(f"{c['numel'] * c['itemsize'] / 1e6:.3g}")] += 1
    return " + ".join(f"{n} x {mb:g}" for mb, n in sorted(count.items(), reverse=True)) + " MB"


def trace_table(traces: list[dict], np_: int) -> list[str]:
    lines = ["| row | calls/step | " + " | ".join(f"{op} (calls x MB of the full tensor)" for op in OPS[:3])
             + " | other |", "|---|---|---|---|---|---|"]
    for t in traces:
        if t["np"] != np_:
            continue
        if t["status"] != "ok":
            lines.append(f"| {t['label']} | {t['status'].upper()}: {short_error(t)} | | | | |")
            continue
        calls, summ = t["calls"], call_summary(t["calls"])
        other = ", ".join(f"{n} {SHORT[op]} ({mb:.3f} MB)" for op, (n, mb) in summ.items() if op not in OPS[:3])
        lines.append(f"| {t['label']} | {len(calls)} | " + " | ".join(_sizes(calls, op) if op in summ else "-"
                                                                  for op in OPS[:3]) + f" | {other or '-'} |")
    return lines


def time_table(traces: list[dict], folded: dict, np_: int) -> list[str]:
    lines = ["| row | MPICH shm s/step (median, spread) | gloo TCP s/step (median, spread) | gloo / MPICH "
             "(range) | split on gloo TCP (s) |", "|---|---|---|---|---|"]
    for t in traces:
        m, g = folded.get((np_, t["row"], "mpi")), folded.get((np_, t["row"], "gloo"))
        if t["np"] != np_ or not (m and g):
            continue
        r = _ratio(g, m)
        rng = f" ({r['lo']:.2f}-{r['hi']:.2f})" if min(g["repeats"], m["repeats"]) > 1 else ""
        split = ", ".join(f"{SHORT[op]} {s:.3f}" for op, s in sorted(g["op_s"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {t['label']} | {_s(m)} | {_s(g)} | {r['median']:.2f}{rng} | {split} |")
    return lines


def _ratio(a: dict, b: dict) -> dict:
    return dict(median=a["median"] / b["median"], lo=a["lo"] / b["hi"], hi=a["hi"] / b["lo"])


def _diff(a: dict, b: dict) -> dict:
    """a - b with the range the two spreads allow."""
    return dict(median=a["median"] - b["median"], lo=a["lo"] - b["hi"], hi=a["hi"] - b["lo"])


def _d(x: dict) -> str:
    return f"{x['median']:+.3f} ({x['lo']:+.3f} to {x['hi']:+.3f})"


def gap_table(folded: dict, peers: list[dict], size: str, gaps=GAPS) -> list[str]:
    """Step-time gap (peer - zerompi, from the bench_peers run) beside the collectives' time on each transport."""
    rows = {(r["np"], r["row"]): r for r in peers if r["size"] == size and r.get("repeats_ok", 1) > 0
            and r["status"] == "ok"}
    lines = ["| comparison | ranks | step gap s: peer - zerompi (range) | zerompi's collectives on MPICH shm s "
             "| peer's on gloo TCP s | peer's on MPICH shm s | transport: peer's gloo - MPICH s (range) "
             "| transport / gap | pattern: peer's - zerompi's, both on MPICH s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, z, peer in gaps:
        for np_ in sorted({n for n, _ in rows}):
            zr, pr = rows.get((np_, z)), rows.get((np_, peer))
            zm, pg, pm = (folded.get((np_, k, tr)) for k, tr in ((z, "mpi"), (peer, "gloo"), (peer, "mpi")))
            if not (zr and pr and zm and pg and pm):
                continue
            gap = dict(median=pr["step_s_median"] - zr["step_s_median"], lo=pr["step_s_lo"] - zr["step_s_hi"],
                       hi=pr["step_s_hi"] - zr["step_s_lo"])
            transport, pattern = _diff(pg, pm), _diff(pm, zm)
            pct = f"{100 * transport['median'] / gap['median']:.0f}%" if gap["median"] > 0 else ""
            share = (pct if gap["lo"] > 0 else f"{pct + ' of the median gap; ' if pct else ''}gap at parity "
                     "(range contains 0)" if gap["lo"] <= 0 <= gap["hi"] else "peer faster")
            lines.append(f"| {label} | {np_} | {_d(gap)} | {_s(zm)} | {_s(pg)} | {_s(pm)} | {_d(transport)} "
                         f"| {share} | {pattern['median']:+.3f} |")
    return lines if len(lines) > 2 else []


def header(meta: dict) -> list[str]:
    s, v = meta["settings"], meta["versions"]
    la0, la1 = meta["loadavg_start"], meta.get("loadavg_end", meta["loadavg_start"])
    model = s.get("model") or f"{s['size']} GPT, bucket {s['bucket_mb']} MB"
    return [
        "# Collectives of one training step: MPICH shared memory and gloo over TCP loopback", "",
        f"- date: {meta['date']}; host {meta['host']}: {meta['cpu']}, {meta['cores']} cores; {meta['os']}",
        f"- versions: Python {meta['python']}, " + ", ".join(f"{k} {val}" for k, val in v.items() if val)
        + f"; {meta['mpi']}; zerompi commit {meta['zerompi_commit']}"
        + (f" + uncommitted changes to {', '.join(meta['dirty'])}" if meta.get("dirty") else ""),
        f"- settings: {model}, ranks {s['np']}; calls traced in one timed step "
        f"(after {s['trace_warmup']} warm-up step) of each row; each row's calls replayed {s['warmup']} + "
        f"{s['iters']} times per job, {s['repeats']} interleaved repeats of every (ranks, transport) job"
        + ("; MPICH ranks yield while waiting" if s["mpich_yield"] else ""),
        f"- load average (1, 5, 15 min) at start {load(la0)}, at end {load(la1)}", "",
    ]


NOTES = [
    "How: every collective a row issued in one timed step of its training (traced by `peers/calltrace.py`: "
    "zerompi's `ProcessGroup` calls, the peers' `torch.distributed` calls, DDP's buckets through torch's own "
    "`allreduce_hook`) is replayed alone, in order, blocking, on buffers of the same size, with no compute in "
    "between. MPICH shm: mpi4py on `MPI_COMM_WORLD` with the calls zerompi/comm/mpi.py makes (`Reduce_scatter_block`, "
    "`Allgather`, `Allreduce(IN_PLACE)`, `Bcast`; 16-bit tensors as zerompi moves them: gathered as int16 views, "
    "reduce-scattered as an `Alltoall` of int16 views summed in fp32); MPICH between ranks of one node uses shared "
    "memory. gloo TCP: "
    "`torch.distributed` on a gloo group that rendezvoused at 127.0.0.1, exactly as the peer rows do, with the "
    "function the row called (zerompi's calls: `reduce_scatter_single`, `all_gather_single`, `all_reduce`); "
    "the host name resolves to {gloo_addr}, where gloo's ranks connect to each other. "
    "A repeat's time is the median over its iterations of the slowest rank; the table gives the median over "
    "repeats and their spread.",
    "",
    "Reading the gap table: transport is what the peer's own collectives cost on gloo TCP beyond the same calls "
    "on MPICH shm; pattern is what the peer's collectives cost beyond zerompi's when both run on MPICH shm "
    "(number and size of calls). Both are times of the collectives alone: in a step, a framework hides part of "
    "them behind compute (DDP all-reduces buckets during the backward, DeepSpeed issues its all-gathers "
    "asynchronously), and on 2 cores the gloo and MPI progress competes with compute for the same cores, so "
    "a share is what transport would cost if none of it were hidden, not an exact split of the gap.",
    "",
]


def _run_note(run: dict) -> str:
    """Where a step-time run's numbers come from: its file, commit and load."""
    m = run["meta"]
    commit = m.get("commit") or m.get("zerompi_commit", "?")
    la0, la1 = m.get("loadavg_start"), m.get("loadavg_end")
    load = f"; load average {la0[0]:.2f} at its start" + (f", {la1[0]:.2f} at its end" if la1 else "") if la0 else ""
    return f"step times from `{run['name']}`, commit {commit}, {m['date']}{load}"


def markdown(meta: dict, traces: list[dict], times: list[dict], peers: list[dict] | None = None,
             reading: str | None = None) -> str:
    """``peers``: the step-time runs of bench_transport.load_peers (name, meta, folded rows), one gap table each."""
    folded = fold_times(times)
    nps = sorted({t["np"] for t in traces})
    parts = header(meta)
    for np_ in nps:
        parts += [f"## {np_} ranks", "", "Collectives per step (traced):", "", *trace_table(traces, np_), "",
                  "Seconds per step in those collectives, on each transport:", "",
                  *time_table(traces, folded, np_), ""]
    failed = [t for t in times if t["status"] != "ok"]
    if failed:
        parts += ["Failed jobs (left out):", ""] + [
            f"- {t['np']} ranks, {TRANSPORTS[t['transport']]}, repeat {t['repeat']}: {short_error(t)}"
            for t in failed] + [""]
    for run in peers or []:
        gaps = gap_table(folded, run["rows"], meta["settings"]["size"],
                         LORA_GAPS if meta["settings"].get("lora") else GAPS)
        if gaps:
            parts += [f"## How much of the step-time gap is transport ({_run_note(run)})", "", *gaps, ""]
    parts += [n.format(gloo_addr=meta.get("gloo_host_address", "?")) for n in NOTES]
    if reading:
        parts += ["## Reading", "", *reading.strip().splitlines(), ""]
    return "\n".join(parts)
