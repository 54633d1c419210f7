"""The markdown report of a bench_muon.py run: header, the rows' table, the ratios, the state per rank.

Repeats are folded first (harness/summary.py): a row's step time is the median over repeats of each
repeat's median step (slowest rank), with the spread (min-max) of those; a ratio carries the range
the two rows' spreads allow ("at parity" where it contains 1.0). Bytes and state are the same in
every repeat (same steps, same layout): the first ok repeat's are shown.
"""
from __future__ import annotations

from harness import summary
from harness.markdown import load, short_error, table
from harness.paths import shown

MiB = 2**20
BYTES_TARGET = 1.05  # zerompi's Muon + AdamW over its AdamW, bytes per step at the same stage (issue #42)
KINDS = ("reduce_scatter", "all_gather", "all_reduce", "broadcast")


def header(meta: dict, results: list[dict], jsonl) -> list[str]:
    s, v = meta["settings"], meta["versions"]
    la0, la1 = meta["loadavg_start"], meta.get("loadavg_end", meta["loadavg_start"])
    dirty = any(r.get("stamp", {}).get("dirty") for r in results)
    commits = list(dict.fromkeys(r.get("stamp", {}).get("commit", "?")[:7] for r in results))
    loads = [r["loadavg_before"][0] for r in results if r.get("loadavg_before")]
    params = next((r["params"] for r in results if "params" in r), 0)
    muon = next((r["muon_params"] for r in results if "muon_params" in r), 0)
    return [
        "# What Muon costs: zerompi and DeepSpeed, stages 2 and 3", "",
        (f"- date: {meta['date']}; host {meta['host']}: {meta['cpu']}, {meta['cores']} cores, "
         f"{meta['mem_gib']:.0f} GiB; {meta['os']}"),
        f"- versions: Python {meta['python']}, " + ", ".join(f"{k} {x}" for k, x in v.items() if x)
        + f"; {meta['mpi']}; commit {meta['commit']} at the start"
        + (f", HEAD when the rows finished: {', '.join(commits)}" if commits != [meta["commit"][:7]] else "")
        + (" (tree with uncommitted changes)" if dirty else ""),
        (f"- model: GPT {s['size']} ({params / 1e6:.2f}M parameters, {muon / 1e6:.2f}M of them in the hidden "
         f"matrices that Muon steps), {s['np']} ranks, sequence {s['seq']}, micro-batch {s['micro_batch']} "
         f"per rank, {s['dtype']}, {s['threads_per_rank']} torch thread per rank, zerompi bucket {s['bucket_mb']} MB"),
        (f"- optimizers: AdamW lr {s['lr']} betas 0.9/0.999 eps 1e-8 wd {s['weight_decay']}; Muon lr {s['muon_lr']} "
         f"momentum {s['momentum']} (Nesterov), 5 Newton-Schulz steps in bf16, wd {s['weight_decay']}; no clipping"),
        f"- {s['warmup']} warm-up + {s['steps']} timed steps per repeat, {s['repeats']} interleaved repeats "
        "(repeat 1 of every row, then repeat 2, ...; each repeat its own mpiexec job)"
        + ("; MPICH ranks yield while waiting" if s["mpich_yield"] else ""),
        f"- load average (1, 5, 15 min) at start {load(la0)}, at end {load(la1)}; 1-min load before the rows' "
        f"jobs {min(loads):.2f}-{max(loads):.2f} on {meta['cores']} cores (the machine was shared: other work "
        "shows here and in each row's spread)" if loads else "",
        (f"- command: `python benchmarks/bench_muon.py --repeats {s['repeats']} --steps {s['steps']} "
         f"--warmup {s['warmup']} --rows {','.join(s['rows'])}`; rows: `{shown(jsonl)}`"), ""]


def _ok(folded: dict, key: str) -> dict | None:
    r = folded.get(key)
    return r if r is not None and r.get("repeats_ok") else None


def _mb(x: float) -> str:
    return f"{x / 1e6:.1f}"


def _per_rank(r: dict, key: str) -> str:
    return " / ".join(f"{p.get(key, 0) / MiB:.1f}" for p in r["per_rank"])


def _row_cells(r: dict, base: dict | None) -> list[str]:
    kinds = r["bytes_per_step_kinds"]
    by_kind = ", ".join(f"{k.replace('_', '-')} {_mb(kinds[k])}" for k in KINDS if kinds.get(k))
    step = summary.fmt_ratio(summary.ratio(r, base)) if base else "–"
    nbytes = f"{r['bytes_per_step'] / base['bytes_per_step']:.3f}" if base else "–"
    balance = f"{r['muon_balance']:.3f}" if r.get("muon_balance") else "–"
    loads = "/".join(f"{la[0]:.1f}" for la in r.get("loadavg_before_repeats", []) if la)
    return [r["label"], f"{r['step_s_median']:.2f} ({r['step_s_lo']:.2f}–{r['step_s_hi']:.2f})",
            f"{r['repeats_ok']} of {r['repeats']}", step, _mb(r["bytes_per_step"]), by_kind, nbytes,
            _per_rank(r, "opt_state_bytes"), _per_rank(r, "muon_state_bytes"), balance,
            f"{r['loss_final']:.5f}", loads]


HEAD = ["row", "step s, median (min–max of repeats)", "repeats", "step x zerompi AdamW (range, verdict)",
        "MB sent/step/rank", "by collective, MB", "bytes x zerompi AdamW", "optimizer state MiB, rank 0 / 1",
        "Muon state MiB, rank 0 / 1", "Muon balance (max/mean)", "final loss", "1-min load before each repeat"]


def rows_table(folded: dict[str, dict]) -> list[str]:
    body = []
    for r in folded.values():
        if not r.get("repeats_ok"):
            body.append([r["label"], f"{r['status']}: {short_error(r)}", f"0 of {r['repeats']}"]
                        + ["–"] * (len(HEAD) - 3))
            continue
        body.append(_row_cells(r, _ok(folded, f"z{r['stage']}-adamw")))
    return table(HEAD, body)


def ratios(folded: dict[str, dict]) -> list[str]:
    """The issue's questions, one line each: bytes and step time against AdamW and DeepSpeed's Muon."""
    out = ["## Ratios", ""]
    for s in (2, 3):
        za, zm, dm = (_ok(folded, f"{k}{s}-{o}") for k, o in (("z", "adamw"), ("z", "muon"), ("ds", "muon")))
        if za and zm:
            b = zm["bytes_per_step"] / za["bytes_per_step"]
            verdict = "met" if b <= BYTES_TARGET else "MISSED"
            out.append(f"- stage {s}, zerompi Muon + AdamW / zerompi AdamW: bytes per step {b:.3f} "
                       f"(target <= {BYTES_TARGET}: {verdict}); step time {summary.fmt_ratio(summary.ratio(zm, za))}")
        if zm and dm:
            out.append(f"- stage {s}, zerompi Muon + AdamW / DeepSpeed Muon: step time "
                       f"{summary.fmt_ratio(summary.ratio(zm, dm))}; bytes per step "
                       f"{zm['bytes_per_step'] / dm['bytes_per_step']:.3f}; optimizer state on the largest rank "
                       f"{max(zm['opt_state_bytes_per_rank']) / max(dm['opt_state_bytes_per_rank']):.3f}")
        da = _ok(folded, f"ds{s}-adamw")
        if da and dm:
            out.append(f"- stage {s}, DeepSpeed Muon / DeepSpeed AdamW: bytes per step "
                       f"{dm['bytes_per_step'] / da['bytes_per_step']:.3f}; step time "
                       f"{summary.fmt_ratio(summary.ratio(dm, da))}")
        if zm and not dm and f"ds{s}-muon" in folded:
            out.append(f"- stage {s}, DeepSpeed Muon did not run: {short_error(folded[f'ds{s}-muon'])}")
    return out + [""]


def state_lines(folded: dict[str, dict]) -> list[str]:
    """Muon state against one momentum per Muon parameter (4 bytes each), summed over the ranks."""
    out = ["## Muon state: where it lives", ""]
    for r in folded.values():
        if not r.get("repeats_ok") or r["optimizer"] != "muon":
            continue
        total = sum(p["muon_state_bytes"] + p.get("muon_staging_bytes", 0) for p in r["per_rank"])
        once = 4 * r["muon_params"]
        staged = sum(p.get("muon_staging_bytes", 0) for p in r["per_rank"])
        out.append(f"- {r['label']}: Muon state {total / MiB:.1f} MiB over all ranks = {total / once:.2f}x one fp32 "
                   f"momentum per Muon parameter ({once / MiB:.1f} MiB)"
                   + (f", of which {staged / MiB:.1f} MiB is DeepSpeed's staged copy of the momentum "
                      "(`_muon_pending_momentum`)" if staged else "")
                   + ("; zerompi Muon parameters owned per rank: "
                      + " / ".join(f"{p['muon_params_owned'] / 1e6:.2f}M" for p in r["per_rank"])
                      if "muon_params_owned" in r["per_rank"][0] else ""))
    return out + [""]


def markdown(meta: dict, results: list[dict], reading: str | None, jsonl) -> str:
    folded = {r["row"]: r for r in summary.fold(results)}
    failed = [f"- {r['label']} repeat {r.get('repeat', 0) + 1}: {short_error(r)}"
              for r in results if r["status"] != "ok"]
    lines = [*header(meta, results, jsonl), *rows_table(folded), *ratios(folded), *state_lines(folded)]
    if failed:
        lines += ["## Jobs that did not finish", "", *failed, ""]
    if reading:
        lines += ["## Reading", "", reading.strip(), ""]
    return "\n".join(lines)
