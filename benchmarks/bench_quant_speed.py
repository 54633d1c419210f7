"""Speed of quantized collectives: codec kernels, the collectives they shrink, a rate-limited link, a projection.

    .venv/bin/python benchmarks/bench_quant_speed.py kernels        # codec GB/s and error per block size
    .venv/bin/python benchmarks/bench_quant_speed.py collectives    # 2 ranks, MPICH shared memory
    .venv/bin/python benchmarks/bench_quant_speed.py link           # again until it says "complete"
    .venv/bin/python benchmarks/bench_quant_speed.py report         # results/quantized-speed.md

* kernels: encode/decode throughput of comm/codec.py on one thread, in the process's CPU time
  (the machine is shared: wall time would count other jobs), and the relative L2 error of the
  default GPT's weights and gradients per block size, beside the bytes per element;
* collectives: the fp32/bf16 all-gather and reduce-scatter of 2^20 and 2^22 elements per rank beside
  their int8/int4 versions (codec included) on 2 ranks over MPICH's shared memory (wall time);
* link: the default GPT's stage-3 step (jobs/configs/default.toml, 2 ranks) unquantized and
  quantized, with MPICH forced onto TCP (``MPIR_CVAR_NOLOCAL=1``, libfabric's tcp provider) over the
  loopback of a private network namespace (``unshare -n``), rate-limited by the kernel's traffic
  control (``tc ... tbf``): unlimited, 1 Gbit/s and 200 Mbit/s shared by both ranks' traffic.
  Runs go in repeats, each repeat every link and variant in turn; one invocation takes about
  ``--budget-s`` seconds and the next continues where it stopped;
* report: the tables, and an α-β projection (tools/commtime.py) for 25/100/400 Gb/s links at
  16-1024 ranks of a 1.3B-parameter bf16 model at stage 3, with the codec's time from the
  measured kernels added to the quantized rows.

Every record goes to results/quantized-speed.jsonl (``--out``), stamped by the harness (commit, load average, ...).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from zerompi.tools import commtime  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import launch, markdown, rows  # noqa: E402
from harness.paths import RESULTS, WORKERS  # noqa: E402

OUT = RESULTS / "quantized-speed"  # .jsonl: every record of every run, appended; .md: the report
WORKER = WORKERS / "quant_speed_worker.py"
LINKS = {"shm": None, "tcp": "", "tcp-1gbit": "1gbit", "tcp-200mbit": "200mbit"}
STEP_VARIANTS = ("none", "w8g8", "w8g4")
TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPICH_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def record(doc: dict, out: Path) -> None:
    with rows.RowLog(out.with_suffix(".jsonl"), mode=rows.Mode.APPEND) as log:
        log.add(doc)


def history(out: Path) -> list[dict]:
    path = out.with_suffix(".jsonl")
    return rows.read(path) if path.exists() else []


def worker(cmd: list[str], env: dict | None = None, netns: str | None = None) -> dict:
    """Run the worker (``cmd`` is its launcher and arguments) and return its JSON document."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        full = [*cmd, "--out", str(out)]
        if netns is not None:  # a private loopback, rate-limited when netns names a rate
            shaping = f"tc qdisc add dev lo root tbf rate {netns} burst 256kb latency 100ms && " if netns else ""
            full = ["unshare", "-n", "bash", "-c", f"ip link set lo up && {shaping}exec {shlex.join(full)}"]
        job, doc = launch.run_json(full, out, launch.job_env(mpich_yield=True, extra=env or {}), timeout=1200)
        if not job.ok:
            raise SystemExit(f"{' '.join(full)} failed: {job.error(lines=40)}")
        return doc


def cmd_kernels(args) -> int:
    doc = worker([sys.executable, str(WORKER), "kernels", "--repeats", str(args.repeats)],
                 env={"OMP_NUM_THREADS": "1"})
    record(doc, args.out)
    return 0


def cmd_collectives(args) -> int:
    for numel in (2**20, 2**22):
        doc = worker(launch.mpi_command(2, WORKER, "collectives", "--numel", numel, "--repeats", args.repeats))
        record(doc, args.out)
    return 0


def cmd_link(args) -> int:
    done = [(r["repeat"], r["link"], r["variant"]) for r in history(args.out) if r.get("mode") == "step"]
    plan = [(rep, link, v) for rep in range(args.repeats) for link in LINKS for v in STEP_VARIANTS]
    began = time.perf_counter()
    for rep, link, variant in plan:
        if (rep, link, variant) in done:
            continue
        if time.perf_counter() - began > args.budget_s - 120:
            print(f"budget spent; next: repeat {rep} {link} {variant}")
            return 0
        rate = LINKS[link]
        doc = worker(launch.mpi_command(2, WORKER, "step", "--variant", variant, "--steps", args.steps),
                     env=TCP_ENV if rate is not None else None, netns=rate)
        doc.update(repeat=rep, link=link)
        record(doc, args.out)
        print(json.dumps({k: doc[k] for k in ("repeat", "link", "variant")}), statistics.median(doc["seconds"]),
              flush=True)
    print("complete: every repeat of every link and variant ran")
    return 0


# ---- report ------------------------------------------------------------------------------------

def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def kernel_lines(doc: dict) -> tuple[list[str], dict]:
    lines = ["## Codec kernels (one thread, CPU time)", "",
             "GB/s of fp32 values (4 bytes each) encoded or decoded; median of the repeats [min-max time].", "",
             "| op | codec | values | GB/s | ms |", "|---|---|---|---|---|"]
    rate = {}
    for r in doc["rows"]:
        t = _med(r["seconds"])
        gbs = r["numel"] * 4 / t / 1e9
        rate[(r["op"], r["codec"], r["numel"])] = gbs
        lines.append(f"| {r['op']} | {r['codec']} | {r['numel']:,} | {gbs:.2f} | {t * 1e3:.2f} "
                     f"[{min(r['seconds']) * 1e3:.2f}-{max(r['seconds']) * 1e3:.2f}] |")
    lines += ["", "Relative L2 error of one quantisation of the default GPT's weights and of one batch's gradient, "
              "and the bytes per element sent:", "", "| block | codec | bytes/element | weights | gradients |",
              "|---|---|---|---|---|"]
    table: dict[tuple, dict] = {}
    for e in doc["errors"]:
        table.setdefault((e["block"], e["codec"]), {"bytes": e["bytes_per_element"]})[e["what"]] = e["rel_l2"]
    for (block, codec), v in sorted(table.items()):
        lines.append(f"| {block} | {codec} | {v['bytes']:.4f} | {v['weights']:.4f} | {v['gradients']:.4f} |")
    return lines + [""], rate


LABELS = {"all_gather int8 (codes only)": "all_gather int8 (gather the codes, decode every chunk)"}


def collective_lines(docs: list[dict]) -> list[str]:
    lines = ["## Collectives on 2 ranks (MPICH shared memory, wall time of the slowest rank)", "",
             "Wall time on the loaded machine: both ranks compete with other jobs for 2 cores, so operations that "
             "compute (the 16-bit sum, the codec) are inflated far more than the copies MPI does; the rows of the "
             "codes alone are what crosses.", "",
             "| op | values per rank | ms, median [min-max] |", "|---|---|---|"]
    for doc in docs:
        for r in doc["rows"]:
            r = {**r, "op": LABELS.get(r["op"], r["op"])}
            s = r["seconds"]
            lines.append(f"| {r['op']} | {r['numel']:,} | {_med(s) * 1e3:.1f} [{min(s) * 1e3:.1f}-{max(s) * 1e3:.1f}] |")
    return lines + [""]


def link_lines(rows: list[dict]) -> list[str]:
    lines = ["## Default GPT step, stage 3, 2 ranks, on a rate-limited link", "",
             "Step time: median over the repeats of each run's median step; [range of the runs' medians]; "
             "bytes one rank sends per step (all collectives).", "",
             "| link | variant | s/step | of none | bytes/step |", "|---|---|---|---|---|"]
    by: dict[tuple, list[float]] = {}
    sent = {}
    for r in rows:
        by.setdefault((r["link"], r["variant"]), []).append(_med(r["seconds"]))
        sent[(r["link"], r["variant"])] = sum(v for k, v in r["bytes_per_step"].items()
                                              if k.split("@")[0].split(".")[0] in ("all_gather", "reduce_scatter"))
    for link in LINKS:
        base = by.get((link, "none"))
        for v in STEP_VARIANTS:
            xs = by.get((link, v))
            if not xs:
                continue
            ratio = f"{_med(xs) / _med(base):.2f}" if base else "-"
            lines.append(f"| {link} | {v} | {_med(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}] | {ratio} | "
                         f"{sent[(link, v)]:,} |")
    return lines + [""]


def projection_lines(rate: dict) -> list[str]:
    """α-β communication time per step of a 1.3B bf16 model at stage 3, plus this CPU's codec time."""
    psi, c = 1_300_000_000, 2
    q = commtime.Quantization("int8", "int4", 256)
    big = 2**24
    enc8, dec8 = rate[("encode", "int8", big)], rate[("decode", "int8", big)]
    enc4 = rate[("encode+residual", "int4", big)]
    dec4 = rate[("decode", "int4", big)]
    # per step and rank: weights decoded twice (forward, backward gathers: Ψ values each) and encoded
    # once (its shard); the gradient encoded whole (Ψ, with error feedback) and Ψ values decoded
    codec_s = lambda n: 4 * (2 * psi / (dec8 * 1e9) + psi / n / (enc8 * 1e9) + psi / (enc4 * 1e9)  # noqa: E731
                             + psi / (dec4 * 1e9))
    lines = ["## α-β projection: 1.3B parameters, bf16, stage 3, int8 weights + int4 gradients with error feedback",
             "", "Communication per rank per step from tools/commtime.py (`(N-1)(α + chunk/β)` per collective, "
             "α = 5 µs), nothing overlapped; the quantized rows add this machine's codec time on one thread "
             "(the kernels above: two int8 decodes of Ψ values, one int8 encode of the shard, one int4 encode "
             "with residual and one int4 decode of Ψ values).", "",
             "| link | ranks | unquantized s | quantized comm s | comm speed-up | + codec s | total s | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for gbps in (25, 100, 400):
        for n in (16, 64, 256, 1024):
            shard = -(-psi // n)
            link = (gbps * 1e9, 5e-6)
            base = commtime.step_comm(shard, n, 3, c, commtime.Quantization(), link).seconds
            comm = commtime.step_comm(shard, n, 3, c, q, link).seconds
            total = comm + codec_s(n)
            lines.append(f"| {gbps} Gb/s | {n} | {base:.3f} | {comm:.3f} | {base / comm:.2f} | {codec_s(n):.3f} | "
                         f"{total:.3f} | {base / total:.2f} |")
    saved = (3 * 2 - (2 * (1 + 4 / 256) + (0.5 + 4 / 256)))  # bytes per parameter per step, N large
    breakeven = saved * psi * 8 / codec_s(1024) / 1e9
    lines += ["", f"With these CPU kernels quantisation pays below about {breakeven:.1f} Gb/s per rank (where the "
              f"{saved:.2f} bytes per parameter it saves take longer on the link than the codec takes); the "
              "communication alone shrinks to "
              f"{(2 * (1 + 4 / 256) + (0.5 + 4 / 256)) / 6:.3f} of the bf16 bytes whatever the link (the comm "
              "speed-up column: what kernels much faster than these, e.g. an accelerator's, would leave).", ""]
    return lines


def cmd_report(args) -> int:
    found = history(args.out)
    kernels = [r for r in found if r.get("mode") == "kernels"][-1]
    collectives = [r for r in found if r.get("mode") == "collectives"][-2:]
    steps = [r for r in found if r.get("mode") == "step"]
    klines, rate = kernel_lines(kernels)
    loads = [rows.load_of(r) for r in found]
    lines = ["# Speed of quantized collectives", "",
             "Written by `benchmarks/bench_quant_speed.py report` (its docstring says what each part measures). "
             f"Commits: {', '.join(sorted({rows.commit_of(r)[:7] for r in found}))}; 1-minute load average at the records "
             f"{min(loads):.1f} to {max(loads):.1f} on 2 cores shared with other jobs.", ""]
    lines += klines + collective_lines(collectives) + link_lines(steps) + projection_lines(rate)
    markdown.write(args.out.with_suffix(".md"), "\n".join(lines))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("kernels", "collectives", "link", "report"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="timed steps per link run")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--out", type=Path, default=OUT, help="results prefix (default benchmarks/results/quantized-speed)")
    args = p.parse_args()
    if args.mode == "link" and args.repeats == 5:
        args.repeats = 3
    modes = {"kernels": cmd_kernels, "collectives": cmd_collectives, "link": cmd_link, "report": cmd_report}
    return modes[args.mode](args)


if __name__ == "__main__":
    raise SystemExit(main())
