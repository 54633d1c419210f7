"""The GPT ladder of bench_capacity.py (``GPT``: capacity.*): its model, and the paragraphs computed
from its data, beside lora_report.py's LoRA ladder."""
from __future__ import annotations

from capacity_report import GiB, Study, nvme_slope, swap_traffic


def gpt_readings(data: dict) -> list[str]:
    """The GPT ladder's own paragraphs, computed from its data."""
    best, out = data["best"], []
    s0, nv = best.get("stage0", {}).get("params"), best.get("stage3+nvme", {}).get("params")
    if s0 and nv:
        out.append(f"NVMe offload trains {nv / s0:.1f}× the parameters of stage 0 under the same cap (target ≥ 8×)"
                   + (", and it was not stopped by memory: the ladder ended, or the next rung ran out of time "
                      "or disk." if best["stage3+nvme"]["why"] != "OOM killed" else "."))
    s3, cpu = best.get("stage3", {}).get("params"), best.get("stage3+cpu", {}).get("params")
    if s3 and cpu:
        out.append(f"'cpu' offload trains {cpu / s3:.2f}× what stage 3 trains. On this machine the CPU is the "
                   "device, so 'cpu' offload has nothing to move out of the memory the cap counts; on a GPU node "
                   "the same setting moves the optimizer state and parameter shards off the GPU.")
    text = ("With NVMe offload the model states resident between uses are none: parameter, gradient and optimizer "
            "shards live in the swap files, and memory holds one gathered unit (plus three read ahead, with "
            "their optimizer state under optimizer_in_backward), two buckets being written behind, a pool of "
            "released blocks (a dozen of the largest shard, four of the largest gathered bucket) and the swap "
            "buffers, whatever the depth; what grows with the model is the time per step (disk traffic) and the "
            "swap files (16 bytes per parameter in fp32: master, which the fp32 parameter shard is read from, "
            "gradient, two moments).")
    slope = nvme_slope(data)
    if slope:
        text += (f" The job's peak still rises {slope[0]:.2f} bytes per parameter across the NVMe rows (host-side "
                 f"bookkeeping, not model state); at that rate the cap would be reached near {slope[1] / 1e9:.0f}B "
                 "parameters, well past what this disk holds or this CPU trains in reasonable time.")
    if "stage3+nvme" in best:
        out.append(text)
    return out + nvme_step(data)


def nvme_step(data: dict) -> list[str]:
    """The largest NVMe trial's step against max(its traffic limit, its compute); compute is the line
    through the in-memory stage-3 trials' s/step against parameters (least squares), extrapolated."""
    ok = {mode: [r for r in data["rows"] if r["mode"] == mode and r["ok"]] for mode in ("stage3", "stage3+nvme")}
    if not ok["stage3+nvme"] or len(ok["stage3"]) < 2:
        return []
    big = max(ok["stage3+nvme"], key=lambda r: r["params"])
    raw = data["measurements"]["stage3+nvme"].get("raw_disk")
    t = swap_traffic(big, data["measurements"]["stage3+nvme"])
    if t is None or t[2] is None:
        return []
    xs, ys = [r["params"] for r in ok["stage3"]], [r["step_s"][-1] for r in ok["stage3"]]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    compute, step = my + slope * (big["params"] - mx), big["step_s"][-1]
    ratio = step / max(t[2], compute)
    rd, wr = t[0] / GiB / raw["read"], t[1] / GiB / raw["write"]
    return [f"At the largest NVMe model ({big['params'] / 1e6:.0f}M parameters) the last step took {step:.1f} s. Its "
            f"swap traffic, {t[0] / GiB:.1f} GiB read and {t[1] / GiB:.1f} GiB written (both ranks, one disk), needs "
            f"at least {t[2]:.1f} s at this run's raw O_DIRECT bandwidths (read {raw['read']:.2f}, write "
            f"{raw['write']:.2f} GiB/s, probed before the mode's trials): the larger of its read time, {rd:.1f} s, and "
            f"its write time, {wr:.1f} s, since the swap threads read and write at once. The compute, extrapolated "
            f"from the stage3 trials (in memory, {slope * 1e9:.1f} s per billion parameters), is about {compute:.1f} s. "
            f"The step is {ratio:.2f}× the larger of the two (target ≤ 1.3×: {'met' if ratio <= 1.3 else 'not met'})."]


def gpt_describe(data: dict) -> str:
    nvme = data["measurements"].get("stage3+nvme", {}).get("nvme_dir")
    return (f"Model: GPT, vocab 256, block 64, n_embd {data['n_embd']}, {data['n_head']} heads, no biases, depth "
            f"along the ladder {GPT.rungs(data['max_rungs'])}, bisected to about 10% after an OOM kill; fp32, AdamW, "
            "bucket_mb 25, built on the meta device and initialised bucket by bucket "
            "(`param_init=model.init_module`); micro-batch 1 × 64 tokens per rank, 2 steps."
            + (f" NVMe: zerompi's default swap settings on the machine's disk (`{nvme}`), with "
               "optimizer_in_backward=True since 529e1da." if nvme else ""))


GPT = Study(key="gpt", stem="capacity", worker="capacity_worker.py",
            modes=("stage0", "stage3", "stage3+cpu", "stage3+nvme"),
            ladder=(2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160),
            model={"n_embd": 1024, "n_head": 16}, quick={"n_embd": 256, "n_head": 8},
            title="Capacity: the largest GPT that trains under one memory cap", describe=gpt_describe,
            readings=gpt_readings, x_label="GPT parameters (millions), each point a run that trained",
            extra_sources=("benchmarks/gpt_report.py",))
