"""Checkpoints against the disk: zerompi's synchronous and asynchronous saves and cold loads beside raw I/O
and torch.distributed.checkpoint (FSDP2), and consolidation memory.

    python benchmarks/bench_checkpoint.py [--dir DIR] [--quick] [--no-peer]

On the disk of --dir, one 2-rank MPI job (workers/ckpt_bench_worker.py) runs every row once per repeat:
zerompi's synchronous save and cold load, an asynchronous save with training steps overlapping it (live
shards, then checkpoint_async_copy), raw I/O of as many bytes in several ways (O_DIRECT or buffered, 1 to 8
threads, 1 to 32 MiB blocks; the fastest of a repeat is "raw"), and DCP's save, cold load and async_save on
the same GPT under FSDP2. Then consolidation's peak RSS on a checkpoint of the same model. Results:
benchmarks/results/checkpoint.{md,jsonl} (with --quick: DIR/zerompi-ckpt-bench-quick/).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(HERE / "workers")]  # the harness; the worker's helpers
import ckpt_bench_worker as worker  # noqa: E402
import diskio  # noqa: E402
from harness import launch, markdown, rows, stamp  # noqa: E402
from harness.markdown import table as _table  # noqa: E402
from harness.summary import spread as summary  # noqa: E402

log = logging.getLogger("bench_checkpoint")
ENV = launch.job_env(mpich_yield=True)
MiB, GiB = 1 << 20, 1 << 30
MODELS = {"full": dict(n_layer=12, n_embd=1024, n_head=16, block=64),
          "quick": dict(n_layer=6, n_embd=512, n_head=8, block=64)}
BASELINE = "import torch, h5py, numpy, zerompi, zerompi.checkpoint"
ITERATE = ("import sys\nfrom zerompi.checkpoint import load_full_state_dict\nsd = load_full_state_dict(sys.argv[1])\n"
           "print(len(sd), sum(float(sd[name].sum()) for name in sd))\n")
SAVE_PARTS = {  # label -> seconds, from one rank's timers (see the worker's instrument())
    "datasets: checksums + pwrite": lambda p: p.get("write@call", 0),
    "HDF5 metadata, close": lambda p: p.get("close", 0) - p.get("fsync@close", 0),
    "fsync of the rank file": lambda p: p.get("fsync@close", 0),
    "index.h5, renames, latest (rank 0)": lambda p: p.get("publish", 0)}
LOAD_PARTS = {"waiting for the reads (pread + checksums into the load's arrays)": lambda p: p.get("read@prepare", 0),
              "index, checks, allocation (the reads run meanwhile)": lambda p: p.get("prepare", 0) - p.get("read@prepare", 0),
              "apply to the engine": lambda p: p.get("apply", 0)}
ASYNC = {"zerompi async (live shards)": ("zerompi", "async_False", "step_False"),
         "zerompi async (checkpoint_async_copy)": ("zerompi", "async_True", "step_True"),
         "torch DCP async_save (FSDP2)": ("dcp", "async", "step")}


def run_worker(world: int, scratch: Path, model: dict, args) -> dict:
    """One MPI job: its JSON and wall time."""
    shutil.rmtree(scratch / "ckpt", ignore_errors=True)
    out = scratch / f"w{world}.json"
    cmd = launch.mpi_command(world, worker.__file__, "--root", scratch / "ckpt", "--out", out, "--repeats",
                             args.repeats, *(["--no-peer"] if args.no_peer else []),
                             *(f"--{k.replace('_', '-')}={v}" for k, v in model.items()))
    job, result = launch.run_json(cmd, out, ENV)
    job.check()
    for line in (ln for ln in job.output.splitlines() if "ranks]" in ln and "bucket " not in ln):
        log.info("%s", line)
    return {**result, "job_seconds": job.wall_s}


def last_checkpoint(scratch: Path, model: dict) -> Path:
    """A checkpoint of the benchmark's model for the consolidation rows (the worker removes its own)."""
    root = scratch / "consolidate"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import ckpt_bench_worker as w, argparse, torch\n"
            "a = argparse.Namespace(**{k: int(v) for k, v in zip(sys.argv[3::2], sys.argv[4::2])}, layout='auto')\n"
            "e, _, _ = w.build_engine(a, 0); e.save_checkpoint(sys.argv[2], 'c'); e.close()\n")
    kv = [x for k, v in model.items() for x in (k, str(v))]
    launch.run(launch.mpi_command(2, "-c", code, HERE / "workers", root, *kv), ENV).check()
    return root


def consolidation(root: Path, scratch: Path) -> list[dict]:
    """Peak RSS of three processes; the consolidated file's largest and smallest tensor checked bit for bit."""
    from zerompi.checkpoint import load_full_state_dict
    py, out = sys.executable, scratch / "consolidated.safetensors"
    cases = [("imports only (baseline)", [py, "-c", BASELINE]),
             ("zerompi ckpt consolidate ROOT OUT.safetensors",
              [py, "-m", "zerompi.tools.cli", "ckpt", "consolidate", str(root), str(out)]),
             ("iterate load_full_state_dict, sum each tensor", [py, "-c", ITERATE, str(root)])]
    rows = []
    for name, cmd in cases:  # each reads the checkpoint cold
        diskio.evict(diskio.files_under(root))
        seconds, peak, text = diskio.child_peak_rss(cmd, ENV, ROOT)
        rows.append({"case": name, "seconds": seconds, "peak_rss": peak, "output": text[-200:]})
        log.info("%s: peak RSS %.0f MiB in %.1f s", name, peak / MiB, seconds)
    with open(out, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    full, equal = load_full_state_dict(root), {}
    numel = {n: int(np.prod(full.shape(n))) for n in full}
    for name in (max(numel, key=numel.get), min(numel, key=numel.get)):
        start, stop = header[name]["data_offsets"]
        data = np.fromfile(out, dtype="<f4", count=(stop - start) // 4, offset=8 + size + start)
        equal[name] = bool(np.array_equal(data.reshape(header[name]["shape"]), full[name].numpy()))
    full.close()
    rows[1]["check"] = {"tensors_checked": equal, "data_bytes": 4 * sum(numel.values()),
                        "file_data_bytes": out.stat().st_size - 8 - size}
    out.unlink()
    return rows


def measure(args, scratch: Path) -> dict:
    model = MODELS["quick" if args.quick else "full"]
    data = {"model": model, "crc32_gibps": diskio.crc32_gibps(), "job": run_worker(2, scratch, model, args)}
    data["consolidation"] = [] if args.no_consolidation else consolidation(last_checkpoint(scratch, model), scratch)
    return data


def _slowest(ranks: list[dict]) -> float:
    return max(r["seconds"] for r in ranks)


def raw_ways(rep: dict) -> dict[str, dict]:
    """A repeat's raw rows by the way they ran: the slowest rank's write and read seconds, scaled to the
    checkpoint's bytes (a run before the several ways had one: buffered 8 MiB writes on one thread)."""
    ways = rep.get("raw") or {"buffered, 1 thread, 8 MiB": {"write": rep["raw_write"], "read": rep["raw_read"]}}
    scale = rep["zerompi"]["bytes"] / rep["raw_bytes"]
    return {name: {k: _slowest(way[k]) * scale for k in ("write", "read")} for name, way in ways.items()}


def per_rep(data: dict) -> list[dict]:
    """Each repeat's numbers (the slowest rank's time of each collective call; bytes on disk). Raw is the
    fastest way of the repeat, for writing and for reading apart."""
    out = []
    for rep in data["job"]["reps"]:
        z, nbytes, ways = rep["zerompi"], rep["zerompi"]["bytes"], raw_ways(rep)
        fastest = {k: min(ways, key=lambda name, k=k: ways[name][k]) for k in ("write", "read")}
        row = {"load": rep["load"], "bytes": nbytes, "save": _slowest(z["save"]), "load_cold": _slowest(z["load_cold"]),
               "raw_write": ways[fastest["write"]]["write"], "raw_read": ways[fastest["read"]]["read"],
               "raw_write_by": fastest["write"], "raw_read_by": fastest["read"], "raw_ways": ways}
        if "dcp" in rep:
            row.update(dcp_bytes=rep["dcp"]["bytes"], dcp_save=_slowest(rep["dcp"]["save"]),
                       dcp_load_cold=_slowest(rep["dcp"]["load_cold"]))
        for label, (who, key, base) in ASYNC.items():
            if who not in rep:
                continue
            a = rep[who][key]
            fence = max(a.get("fence_wait", [0]))
            row[label] = {"call": _slowest(a["call"]), "fence": fence, "blocked": _slowest(a["call"]) + fence,
                          "steps": [_slowest(s) / _slowest(rep[who][base]) for s in a["steps"]],
                          "wait": _slowest(a["wait"]), "sync_save": row["save" if who == "zerompi" else "dcp_save"],
                          "total": _slowest(a["call"]) + sum(_slowest(s) for s in a["steps"]) + _slowest(a["wait"])}
        out.append(row)
    return out


def breakdown(reps: list[list[dict]], parts: dict) -> dict[str, float]:
    """Median over repeats of the mean over ranks of each part; the rest of the call is "other"."""
    per = [{k: statistics.mean(f(r["parts"]) for r in ranks) for k, f in parts.items()} for ranks in reps]
    for row, ranks in zip(per, reps):
        row["other (waiting for ranks, opening files)"] = statistics.mean(r["seconds"] for r in ranks) - sum(row.values())
    return {k: statistics.median(r[k] for r in per) for k in per[0]}


def measurements_of(data: dict) -> list[dict]:
    """One object per measurement, for checkpoint.jsonl."""
    reps, job = per_rep(data), data["job"]
    out = [{"kind": "repeat", **r} for r in reps]
    out.append({"kind": "breakdown", "save": breakdown([r["zerompi"]["save"] for r in job["reps"]], SAVE_PARTS),
                "load_cold": breakdown([r["zerompi"]["load_cold"] for r in job["reps"]], LOAD_PARTS)})
    base = data["consolidation"][0]["peak_rss"] if data["consolidation"] else 0
    out += [{"kind": "consolidation", **c, "above_baseline": c["peak_rss"] - base,
             "largest_tensor_bytes": 4 * job["largest_tensor"], "model_bytes": 4 * job["params"]}
            for c in data["consolidation"]]
    out.append({"kind": "job", **{k: job[k] for k in ("params", "largest_tensor", "setup_seconds", "job_seconds",
                                                      "crc32")}, "crc32_gibps": data["crc32_gibps"]})
    # the run's metadata beside each row's own fields, which win (a repeat's "load" is its own, not the run's)
    return [{"model": data["model"], **data["meta"], **r} for r in out]


def machine(directory: Path) -> dict:
    return stamp.disk_machine(directory)


def _pct(c: dict) -> str:
    return f"{c['median']:.0%} ({c['min']:.0%}–{c['max']:.0%})"


def header(data: dict) -> list[str]:
    meta, m, model, job = data["meta"], data["meta"]["machine"], data["model"], data["job"]
    loads = ", ".join(f"{r['load']:.1f}" for r in job["reps"])
    return [
        "# Checkpoints: synchronous and asynchronous saves, cold loads, against raw I/O and torch DCP", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB RAM, kernel {m['kernel']}, Python "
        f"{m['python']}. Disk: `{m['dir']}` on {m['fs']} (`{m['device']}`). Date: {meta['date']}; zerompi commit "
        f"{meta['commit']}. Run: `python benchmarks/bench_checkpoint.py{' --quick' * meta['quick']}`, "
        f"{meta['run_seconds']:.0f} s. CRC-32: {job['crc32']} ({data['crc32_gibps']:.1f} GiB/s, one thread).", "",
        f"Model: GPT, n_layer {model['n_layer']}, n_embd {model['n_embd']}, vocab 256, block {model['block']}: "
        f"{job['params'] / 1e6:.1f}M parameters; fp32, AdamW, one micro-batch of {model['block']} tokens per rank per "
        "step, 2 ranks. zerompi: ZeRO stage 3, per-rank files (fp32 master, both Adam moments, RNG). Peer: the same "
        "GPT under FSDP2 (`fully_shard` per block, gloo, as `benchmarks/peers/run_fsdp.py`) saved with "
        "`torch.distributed.checkpoint` (`dcp.save`, `dcp.async_save` on a gloo group of its own, `dcp.load`) from "
        "`get_state_dict(model, optimizer)`. Each call is timed on every rank between barriers; the slowest rank's "
        "time counts. Bandwidth = bytes on disk / that time, GiB/s. Cold load: after fsync + POSIX_FADV_DONTNEED of "
        "every file. Raw: each rank writes its half of as many bytes as zerompi's checkpoint to a new file on the same "
        "disk, both ranks at once as in a save, with pwrite of large blocks at their offsets on several threads "
        "(fio-style: O_DIRECT from page-aligned memory, or buffered) + fsync, then reads it back cold with pread "
        "(O_DIRECT, or buffered after POSIX_FADV_DONTNEED), in every way of the raw table below; in each repeat the "
        "fastest way is raw, for writes and reads apart, so a save or load cannot beat it but by noise. "
        "Asynchronous rows: the call, then "
        f"{len(job['reps'][0]['zerompi']['async_False']['steps'])} training steps while the save writes, then the "
        "wait for it; blocked = the call + the time steps waited for buckets the save had not taken (zerompi's "
        "fence); a step's slowdown = its time / the same framework's step without a save in the same repeat. "
        f"Values: median (min–max) of {meta['repeats']} repeats; each repeat runs every row once (interleaved), and "
        "each ratio is taken within a repeat.", "",
        f"Noise: the machine is shared (1-minute load average {meta['load'][0]:.1f} at the start, {meta['load'][1]:.1f} "
        f"at the end, {loads} at each repeat's start, on {m['cores']} cores).", ""]


def _wins(reps: list[dict], key: str) -> str:
    """Which raw ways were the fastest, and in how many repeats."""
    names = [r[key] for r in reps]
    return "; ".join(f"{n} ({names.count(n)}×)" for n in sorted(set(names), key=names.index))


def shares(reps: list[dict]) -> dict[str, dict]:
    """Each row's share of raw, per repeat: raw's time for as many bytes / the row's time (= its GiB/s / raw's)."""
    out = {"zerompi save (synchronous)": summary([r["raw_write"] / r["save"] for r in reps]),
           "zerompi cold load": summary([r["raw_read"] / r["load_cold"] for r in reps])}
    if "dcp_save" in reps[0]:
        out["DCP save (FSDP2)"] = summary([r["raw_write"] * r["dcp_bytes"] / r["bytes"] / r["dcp_save"] for r in reps])
        out["DCP cold load (FSDP2)"] = summary([r["raw_read"] * r["dcp_bytes"] / r["bytes"] / r["dcp_load_cold"]
                                             for r in reps])
    return out


def raw_table(reps: list[dict]) -> list[str]:
    """Every raw way: its GiB/s and the repeats in which it was the fastest."""
    body = []
    for name in reps[0]["raw_ways"]:
        gib = {k: summary([r["bytes"] / GiB / r["raw_ways"][name][k] for r in reps]) for k in ("write", "read")}
        label = name + (" (page cache)" if name.startswith("buffered") else "")
        body.append([label + (", the earlier raw row" if name == "buffered, 1 thread, 8 MiB" else ""),
                     gib["write"], gib["read"], sum(r["raw_write_by"] == name for r in reps),
                     sum(r["raw_read_by"] == name for r in reps)])
    return _table(["raw way (each rank its half, both at once)", "write + fsync GiB/s", "cold read GiB/s",
                   "fastest write in repeats", "fastest read in repeats"], body)


def tables(data: dict, reps: list[dict]) -> list[str]:
    gib = lambda key, nb="bytes": summary([r[nb] / GiB / r[key] for r in reps])  # noqa: E731
    share = shares(reps)
    body = [["zerompi save (synchronous)", gib("save"), _pct(share["zerompi save (synchronous)"]), "raw write + fsync"],
            ["zerompi cold load", gib("load_cold"), _pct(share["zerompi cold load"]), "raw cold read"],
            ["raw write + fsync: the fastest way of each repeat", gib("raw_write"), "", _wins(reps, "raw_write_by")],
            ["raw cold read: the fastest way of each repeat", gib("raw_read"), "", _wins(reps, "raw_read_by")]]
    if "dcp_save" in reps[0]:
        body += [["DCP save (FSDP2)", gib("dcp_save", "dcp_bytes"), _pct(share["DCP save (FSDP2)"]),
                  "raw write + fsync"],
                 ["DCP cold load (FSDP2)", gib("dcp_load_cold", "dcp_bytes"), _pct(share["DCP cold load (FSDP2)"]),
                  "raw cold read"]]
    nb = reps[0]["bytes"]
    out = _table([f"2 ranks, zerompi's checkpoint {nb / 1e9:.2f} GB" + (f", DCP's {reps[0]['dcp_bytes'] / 1e9:.2f} GB"
                  if "dcp_bytes" in reps[0] else ""), "GiB/s", "of raw", "raw row (for raw: the way that won)"], body)
    above = [f"{name} ({_pct(c)})" for name, c in share.items() if c["median"] > 1]
    if above:
        out += ["**Raw was not the fastest:** " + ", ".join(above) + (" is" if len(above) == 1 else " are") +
                " above 100% of raw at the median, so none of the raw ways below reached what this disk does; the "
                "raw measurement must be improved before these shares mean anything.", ""]
    out += raw_table(reps)
    arows = []
    for label in ASYNC:
        if label not in reps[0]:
            continue
        a = [r[label] for r in reps]
        steps = len(a[0]["steps"])
        arows.append([label, summary([x["call"] for x in a]), summary([x["fence"] for x in a]),
                      _pct(summary([x["blocked"] / x["sync_save"] for x in a])),
                      *(summary([x["steps"][i] for x in a]) for i in range(steps)), summary([x["wait"] for x in a]),
                      summary([x["total"] for x in a]), summary([x["sync_save"] for x in a])])
    out += _table(["asynchronous save", "call s", "fence waits s", "blocked / synchronous save",
                   *(f"step {i + 1} / step without save" for i in range(len(reps[0][next(iter(ASYNC))]["steps"]))),
                   "wait after the steps s", "call → done s", "synchronous save s"], arows)
    parts = next(r for r in measurements_of(data) if r["kind"] == "breakdown")
    for kind, label in (("save", "synchronous save"), ("load_cold", "cold load")):
        out += _table([f"zerompi {label}, seconds per rank (median)", "s"],
                      [[k, f"{v:.2f}"] for k, v in parts[kind].items()])
    return out


def consolidation_table(cons: list[dict]) -> list[str]:
    if not cons:
        return []
    out = _table([f"process, on a 2-rank checkpoint (largest tensor {cons[0]['largest_tensor_bytes'] / MiB:.0f} "
                  f"MiB, model {cons[0]['model_bytes'] / MiB:.0f} MiB)", "peak RSS MiB", "above baseline MiB",
                  "× largest tensor", "× model", "seconds"],
                 [[c["case"], f"{c['peak_rss'] / MiB:.0f}", f"{c['above_baseline'] / MiB:.0f}",
                   f"{c['above_baseline'] / c['largest_tensor_bytes']:.1f}",
                   f"{c['above_baseline'] / c['model_bytes']:.3f}", f"{c['seconds']:.1f}"] for c in cons])
    check = cons[1]["check"]
    return out + ["Consolidated file against load_full_state_dict: " + ", ".join(
        f"`{n}` {'identical' if ok else 'DIFFERENT'}" for n, ok in check["tensors_checked"].items())
        + f"; {check['file_data_bytes']} data bytes, {check['data_bytes']} expected.", ""]


def reading(reps: list[dict]) -> str:
    """Against the targets of issue 16, from the medians above."""
    share = shares(reps)
    save, load = share["zerompi save (synchronous)"]["median"], share["zerompi cold load"]["median"]
    live = [r["zerompi async (live shards)"] for r in reps]
    blocked = statistics.median(x["blocked"] / x["sync_save"] for x in live)
    step = statistics.median(x["steps"][0] for x in live)
    verdict = lambda ok: "met" if ok else "not met"  # noqa: E731
    return (f"Reading (targets of issue 16, medians): synchronous save at {save:.0%} of raw write + fsync (the "
            f"fastest raw way; target ≥ 70%: {verdict(save >= 0.7)}); cold load at {load:.0%} of raw cold read "
            f"(≥ 70%: {verdict(load >= 0.7)}); "
            f"the default asynchronous save blocks training for {blocked:.1%} of the synchronous save's time "
            f"(≤ 5%: {verdict(blocked <= 0.05)}); the first step overlapping its write takes {step:.2f}× a step "
            f"without a save (≤ 1.20×: {verdict(step <= 1.2)}). Ratios inside the spread of their repeats are not "
            "different from the target.")


def markdown_report(data: dict, out: list[dict]) -> str:
    reps = [r for r in out if r["kind"] == "repeat"]
    cons = [r for r in out if r["kind"] == "consolidation"]
    return "\n".join(header(data) + tables(data, reps) + consolidation_table(cons) + [reading(reps), ""])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="the scratch folder is made in it")
    p.add_argument("--quick", action="store_true", help="a ~20M-parameter model, one repeat")
    p.add_argument("--repeats", type=int, default=None, help="default 3, 1 with --quick")
    p.add_argument("--no-peer", action="store_true", help="without the torch.distributed.checkpoint rows")
    p.add_argument("--no-consolidation", action="store_true", help="without the consolidation memory rows")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--render", type=Path, default=None, help="only rewrite the report from a run's OUT/checkpoint.json")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.out = args.out or (args.dir / "zerompi-ckpt-bench-quick" if args.quick else HERE / "results")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.render:
        return report(json.loads(args.render.read_text()), args.out)
    scratch = Path(tempfile.mkdtemp(prefix="zerompi-ckpt-bench-", dir=args.dir))
    t0, load0 = time.perf_counter(), stamp.loadavg()[0]
    try:
        data = measure(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    changed = stamp.dirty(("zerompi",))
    commit = stamp.commit(short=True) + (f" with local changes to {', '.join(changed)}" if changed else "")
    data["meta"] = {"date": stamp.utc_now(), "quick": args.quick, "repeats": args.repeats, "commit": commit,
                    "machine": machine(args.dir), "run_seconds": time.perf_counter() - t0,
                    "load": [load0, stamp.loadavg()[0]]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.json").write_text(json.dumps(data))  # what the report is made of (--render)
    report(data, args.out)


def report(data: dict, out: Path) -> None:
    measurements = measurements_of(data)
    rows.write(out / "checkpoint.jsonl", measurements)
    markdown.write(out / "checkpoint.md", markdown_report(data, measurements))


if __name__ == "__main__":
    main()
