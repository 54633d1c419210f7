"""Sharded HDF5 checkpoints: save and load bandwidth against raw I/O, and consolidation memory.

    python benchmarks/bench_checkpoint.py [--dir DIR] [--quick]

On the disk of --dir: save, warm and cold load on 2 ranks (workers/ckpt_bench_worker.py), raw I/O of as many
bytes, consolidation's peak RSS, then --extra-worlds within --budget. Results: benchmarks/results/checkpoint.*
(with --quick, ~50M parameters and 1 repeat: DIR/zerompi-ckpt-bench-quick/checkpoint.*).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE / "workers")]  # run from a checkout, uninstalled
import ckpt_bench_worker as worker  # noqa: E402
from zerompi.tools.mpirun import mpiexec  # noqa: E402
from zerompi.tools.mpirun import mpi_env as _mpi_env  # noqa: E402

log = logging.getLogger("bench_checkpoint")
MiB, GiB = 1 << 20, 1 << 30
MODELS = {"full": dict(n_layer=22, n_embd=1024, n_head=16, block=64),
          "quick": dict(n_layer=16, n_embd=512, n_head=8, block=64)}
BASELINE = "import torch, h5py, numpy, zerompi, zerompi.checkpoint"
ITERATE = ("import sys\nfrom zerompi.checkpoint import load_full_state_dict\nsd = load_full_state_dict(sys.argv[1])\n"
           "print(len(sd), sum(float(sd[name].sum()) for name in sd))\n")
SAVE_PARTS = {  # label -> seconds, from one rank's timers (see the worker's instrument())
    "HDF5 write into the page cache": lambda p: p["write_rank_file"] - p["crc32@write_rank_file"]
    - p["fsync@write_rank_file"],
    "CRC-32 of the data written": lambda p: p["crc32@write_rank_file"],
    "fsync of the rank file": lambda p: p["fsync@write_rank_file"],
    "verify: re-read (HDF5)": lambda p: p["verify"] - p["crc32@verify"], "verify: CRC-32": lambda p: p["crc32@verify"],
    "index.h5, rename, latest (rank 0)": lambda p: p.get("write_index", 0) + p.get("publish", 0)}
LOAD_PARTS = {"HDF5 read": lambda p: p["read@prepare"] - p["crc32@prepare"], "CRC-32": lambda p: p["crc32@prepare"],
              "allocate + copy into new arrays": lambda p: p["prepare"] - p["read@prepare"],
              "apply to the engine": lambda p: p["apply"]}
PARTS = {"save": SAVE_PARTS, "load_warm": LOAD_PARTS, "load_cold": LOAD_PARTS}
RAW_KINDS = ("write", "read_cold", "read_warm")


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def run_worker(world: int, scratch: Path, model: dict, repeats: int) -> dict:
    """One MPI job: its JSON and wall time. Its last checkpoint stays in scratch/ckpt until the next job."""
    shutil.rmtree(scratch / "ckpt", ignore_errors=True)
    out = scratch / f"w{world}.json"
    cmd = [*mpiexec(), "-n", str(world), sys.executable, "-m", "mpi4py", worker.__file__, "--root",
           str(scratch / "ckpt"), "--out", str(out), "--repeats", str(repeats),
           *(f"--{k.replace('_', '-')}={v}" for k, v in model.items())]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_mpi_env(ROOT), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    for line in (ln for ln in proc.stderr.splitlines() if "ranks]" in ln and "bucket " not in ln):
        log.info("%s", line)
    return {**json.loads(out.read_text()), "job_seconds": time.perf_counter() - t0}


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
        worker.evict(worker.files_under(root))
        seconds, peak, text = worker.child_peak_rss(cmd, _mpi_env(ROOT), ROOT)
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


def measure(args, scratch: Path, t0: float) -> dict:
    model = MODELS["quick" if args.quick else "full"]
    data = {"model": model, "crc32_gibps": worker.crc32_gibps(), "raw": {}, "skipped_worlds": []}
    data["jobs"] = {2: run_worker(2, scratch, model, args.repeats)}
    nbytes, buf = data["jobs"][2]["reps"][0]["bytes"], memoryview(os.urandom(worker.BLOCK))
    for _ in range(args.repeats):
        for threads in (1, 2):
            data["raw"].setdefault(threads, []).append(worker.raw_io(scratch, nbytes, threads, buf))
            log.info("raw, %d thread(s): %s", threads, {k: round(v, 2) for k, v in data["raw"][threads][-1].items()})
    data["consolidation"] = consolidation(scratch / "ckpt", scratch)
    for world in [int(w) for w in args.extra_worlds.split(",") if w.strip()]:
        guess = data["jobs"][2]["job_seconds"]  # 1 and 4 ranks with 2 repeats took about as long as 2 with 3
        if time.perf_counter() - t0 + guess > args.budget:
            log.warning("%d ranks skipped: about %.0f s more would exceed --budget %.0f s", world, guess, args.budget)
            data["skipped_worlds"].append(world)
        else:
            data["jobs"][world] = run_worker(world, scratch, model, args.extra_repeats)
    return data


def breakdown(reps: list[list[dict]], parts: dict) -> dict[str, float]:
    """Median over repeats of the mean over ranks of each part; the rest of the call is "other"."""
    per_rep = [{k: statistics.mean(f(r["parts"]) for r in ranks) for k, f in parts.items()} for ranks in reps]
    for row, ranks in zip(per_rep, reps):
        row["other (waiting, opening files)"] = statistics.mean(r["seconds"] for r in ranks) - sum(row.values())
    return {k: statistics.median(r[k] for r in per_rep) for k in per_rep[0]}


def rows(data: dict) -> list[dict]:
    """One object per measurement: save/load per world size, raw I/O, consolidation, crc32."""
    out = []
    for job in data["jobs"].values():
        reps, nbytes = job["reps"], job["reps"][0]["bytes"]
        for kind in ("save", "load_warm", "load_cold"):
            seconds = [max(r["seconds"] for r in rep[kind]) for rep in reps]
            out.append({"kind": kind, "ranks": job["world_size"], "bytes": nbytes, "seconds": summary(seconds),
                        "gibps": summary([nbytes / GiB / s for s in seconds]),
                        "breakdown_s": breakdown([rep[kind] for rep in reps], PARTS[kind]),
                        "peak_rss_growth": max(r["peak_rss_growth"] for rep in reps for r in rep[kind]),
                        "cpu_per_wall": statistics.median(statistics.mean(r["cpu_seconds"] / r["seconds"]
                                                                          for r in rep[kind]) for rep in reps),
                        **{k: [r[k] for r in reps] for k in ("resident_after_save", "resident_after_evict")},
                        **{k: job[k] for k in ("params", "largest_tensor", "setup_seconds", "job_seconds")}})
    out += [{"kind": f"raw_{kind}", "threads": threads, "bytes": reps[0]["bytes"], "resident_after_evict":
             [r["resident_after_evict"] for r in reps], "gibps": summary([r["bytes"] / GiB / r[kind] for r in reps])}
            for threads, reps in data["raw"].items() for kind in RAW_KINDS]
    job, base = data["jobs"][2], data["consolidation"][0]["peak_rss"]
    out += [{"kind": "consolidation", **c, "above_baseline": c["peak_rss"] - base,
             "largest_tensor_bytes": 4 * job["largest_tensor"], "model_bytes": 4 * job["params"]}
            for c in data["consolidation"]] + [{"kind": "crc32", "gibps": data["crc32_gibps"]}]
    return [{**r, "model": data["model"], **data["meta"]} for r in out]


def machine(directory: Path) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mount = max((m for m in map(str.split, open("/proc/mounts")) if directory.resolve().is_relative_to(m[1])),
                key=lambda m: len(m[1]))
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": os.uname().release,
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
            "dir": str(directory), "fs": mount[2], "device": mount[0], "python": sys.version.split()[0]}


def _cell(c) -> str:  # a summary reads "median (min–max)"
    return f"{c['median']:.2f} ({c['min']:.2f}–{c['max']:.2f})" if isinstance(c, dict) else str(c)


def _table(head: list[str], body: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|",
            *("| " + " | ".join(map(_cell, r)) + " |" for r in body), ""]


def _share(parts: dict) -> str:  # the larger parts, with their shares of a rank's time in the call
    total, top = sum(parts.values()), sorted(parts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in top if v > 0.03 * total)


def reading(data: dict, by: dict, consolidation: list[dict]) -> str:
    """The paragraph under the tables, from the 2-rank numbers."""
    save, cold, warm = by["save", 2], by["load_cold", 2], by["load_warm", 2]
    s, c, w = save["seconds"]["median"], cold["seconds"]["median"], warm["seconds"]["median"]
    crc = save["breakdown_s"]["CRC-32 of the data written"] + save["breakdown_s"]["verify: CRC-32"]
    per_rank, (cons, it), rank_save = save["bytes"] / 2 / GiB, consolidation[1:], sum(save["breakdown_s"].values())
    return (f"Reading (2 ranks; the slowest rank's time, then per-rank parts; medians). Save, {s:.2f} s: "
            f"{_share(save['breakdown_s'])}. CRC-32 runs twice over every byte (writing, then verifying): {crc:.2f} s, "
            f"{crc / rank_save:.0%} of a rank's save; one pass over a rank's {per_rank:.2f} GiB at the single-thread "
            f"zlib rate takes {per_rank / data['crc32_gibps']:.2f} s. The verifying re-read is served by the page "
            f"cache (mincore: {100 * min(save['resident_after_save']):.0f}% of the pages resident after the save): it "
            f"checks what HDF5 wrote, not what reached the disk. Cold load, {c:.2f} s: {_share(cold['breakdown_s'])}. "
            f"Warm load, {w:.2f} s: {_share(warm['breakdown_s'])}; its HDF5 read takes "
            f"{warm['breakdown_s']['HDF5 read']:.2f} s against {cold['breakdown_s']['HDF5 read']:.2f} s cold. A load "
            f"reads the rank's whole new state into fresh arrays before replacing the old (peak RSS growth "
            f"{cold['peak_rss_growth'] / GiB:.2f} GiB per rank). Consolidation: above the import baseline, `ckpt "
            f"consolidate` peaks at {cons['above_baseline'] / cons['largest_tensor_bytes']:.1f}× the largest tensor "
            f"and iterating `load_full_state_dict` at {it['above_baseline'] / it['largest_tensor_bytes']:.1f}×; the "
            f"whole model is {cons['model_bytes'] / cons['largest_tensor_bytes']:.0f}× the largest tensor.")


def header(data: dict, by: dict) -> list[str]:
    meta, m, model, job = data["meta"], data["meta"]["machine"], data["model"], data["jobs"][2]
    order = {k: ", ".join(f"{x:.2f}" for x in by[k, 2]["seconds"]["samples"]) for k in PARTS}
    cpu = " / ".join(f"{by[k, 2]['cpu_per_wall']:.0%}" for k in PARTS)
    skipped = f" Skipped (--budget): {data['skipped_worlds']} ranks." * bool(data["skipped_worlds"])
    return [
        "# Sharded HDF5 checkpoints: save and load bandwidth, consolidation memory", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB RAM, kernel {m['kernel']}, Python "
        f"{m['python']}. Disk: `{m['dir']}` on {m['fs']} (`{m['device']}`). Date: {meta['date']}; zerompi commit "
        f"{meta['commit']}. Run: `python benchmarks/bench_checkpoint.py{' --quick' * meta['quick']}`, "
        f"{meta['run_seconds']:.0f} s.", "",
        f"Model: GPT, n_layer {model['n_layer']}, n_embd {model['n_embd']}, vocab 256, block {model['block']}: "
        f"{job['params'] / 1e6:.1f}M parameters, {4 * job['params'] / 1e9:.2f} GB in fp32; ZeRO stage 3, fp32, "
        f"AdamW, one step taken. Its checkpoint (fp32 master, both Adam moments) is {by['save', 2]['bytes'] / 1e9:.2f} "
        "GB on disk (sum of file sizes). Save and load are timed on every rank between barriers; the slowest rank's "
        "time counts; bandwidth = bytes on disk / that time, in GiB/s. Warm load: right after the save. Cold load: "
        f"after fsync + POSIX_FADV_DONTNEED on every file ({100 * max(by['load_cold', 2]['resident_after_evict']):.0f}"
        "% of the pages still resident, by mincore). Raw: as many bytes in 8 MiB buffered writes + fsync, then 8 MiB "
        "reads, cold (evicted the same way) and warm. The breakdown: timers wrapped around zerompi's checkpoint "
        "functions at run time. Peak RSS growth: VmHWM minus VmRSS before the call. A process's peak RSS: ru_maxrss "
        "from wait4, in a small launcher (the count starts at the forking process's RSS). Values: median (min–max) "
        f"of {meta['repeats']} repeats on 2 ranks, {meta['extra_repeats']} on other world sizes.{skipped}", "",
        f"Noise: other jobs shared the {m['cores']} cores and the disk (1-minute load average {meta['load'][0]:.1f} "
        f"at the start, {meta['load'][1]:.1f} at the end). On 2 ranks, in repeat order, saves took {order['save']} s, "
        f"warm loads {order['load_warm']} s, cold loads {order['load_cold']} s: read medians, not single runs. A "
        f"rank's CPU time was {cpu} of its wall time in save / warm load / cold load (the rest: waiting for a CPU, "
        "the disk or other ranks).", ""]


def markdown(data: dict, out: list[dict]) -> str:
    by = {(r["kind"], r.get("ranks", r.get("threads"))): r for r in out}
    cons = [r for r in out if r["kind"] == "consolidation"]
    worlds = sorted(data["jobs"])
    raw_w, raw_r = (max(by[f"raw_{k}", t]["gibps"]["median"] for t in (1, 2)) for k in ("write", "read_cold"))
    lines = header(data, by) + _table(
        ["ranks", "save GiB/s", "warm load GiB/s", "cold load GiB/s", "save / raw write", "cold load / raw read",
         "peak RSS growth per rank: save, load"],
        [[w, *(by[k, w]["gibps"] for k in PARTS),
          f"{by['save', w]['gibps']['median'] / raw_w:.0%}", f"{by['load_cold', w]['gibps']['median'] / raw_r:.0%}",
          f"{by['save', w]['peak_rss_growth'] / MiB:.0f}, {by['load_cold', w]['peak_rss_growth'] / MiB:.0f} MiB"]
         for w in worlds])
    lines += _table([f"raw (ratios above use the best medians; zlib.crc32: {data['crc32_gibps']:.2f} GiB/s)",
                     "write + fsync GiB/s", "cold read GiB/s", "warm read GiB/s"],
                    [[f"{t} thread{'s' * (t > 1)}", *(by[f"raw_{k}", t]["gibps"] for k in RAW_KINDS)] for t in (1, 2)])
    for kind, label in (("save", "save"), ("load_warm", "warm load"), ("load_cold", "cold load")):
        lines += _table([f"{label}, seconds per rank", *(f"{w} rank{'s' * (w > 1)}" for w in worlds)],
                        [[part, *(f"{by[kind, w]['breakdown_s'][part]:.2f}" for w in worlds)]
                         for part in by[kind, 2]["breakdown_s"]]
                        + [["**call, slowest rank**", *(f"{by[kind, w]['seconds']['median']:.2f}" for w in worlds)]])
    lines += _table([f"process, on the 2-rank checkpoint (largest tensor {cons[0]['largest_tensor_bytes'] / MiB:.0f} "
                     f"MiB, model {cons[0]['model_bytes'] / MiB:.0f} MiB)", "peak RSS MiB", "above baseline MiB",
                     "× largest tensor", "× model", "seconds"],
                    [[c["case"], f"{c['peak_rss'] / MiB:.0f}", f"{c['above_baseline'] / MiB:.0f}",
                      f"{c['above_baseline'] / c['largest_tensor_bytes']:.1f}",
                      f"{c['above_baseline'] / c['model_bytes']:.3f}", f"{c['seconds']:.1f}"] for c in cons])
    check = cons[1]["check"]
    lines += ["Consolidated file against load_full_state_dict: " + ", ".join(
        f"`{n}` {'identical' if ok else 'DIFFERENT'}" for n, ok in check["tensors_checked"].items())
        + f"; {check['file_data_bytes']} data bytes, {check['data_bytes']} expected.", "", reading(data, by, cons), ""]
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="the scratch folder is made in it")
    p.add_argument("--quick", action="store_true", help="~50M-parameter model, one repetition")
    p.add_argument("--repeats", type=int, default=None, help="on 2 ranks (default 3, 1 with --quick)")
    p.add_argument("--extra-worlds", default="1,4", help="further world sizes ('' for none)")
    p.add_argument("--budget", type=float, default=300, help="seconds; skip an extra world size that would overrun")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    args = p.parse_args(argv)
    args.repeats, args.extra_repeats = args.repeats or 3 - 2 * args.quick, 1 if args.quick else 2
    args.out = args.out or (args.dir / "zerompi-ckpt-bench-quick" if args.quick else HERE / "results")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    scratch = Path(tempfile.mkdtemp(prefix="zerompi-ckpt-bench-", dir=args.dir))
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    try:
        data = measure(args, scratch, t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    git = [subprocess.run(["git", "-C", str(ROOT), *c], capture_output=True, text=True).stdout.split() for c in
           (["rev-parse", "--short", "HEAD"], ["diff", "--name-only", "HEAD", "--", "zerompi"])]  # read-only
    commit = (git[0] or ["unknown"])[0] + (f" with local changes to {', '.join(git[1])}" if git[1] else "")
    data["meta"] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": args.quick,
                    "repeats": args.repeats, "extra_repeats": args.extra_repeats, "commit": commit, "machine":
                    machine(args.dir), "run_seconds": time.perf_counter() - t0, "load": [load0, os.getloadavg()[0]]}
    measurements = rows(data)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.jsonl").write_text("".join(json.dumps(r) + "\n" for r in measurements))
    (args.out / "checkpoint.md").write_text(text := markdown(data, measurements))
    log.info("results in %s", args.out)
    print(text)


if __name__ == "__main__":
    main()
