"""The LoRA capacity ladder (``bench_capacity.py --lora``): the largest frozen Llama-style base that
LoRA-fine-tunes under the cap, for zerompi's modes and DeepSpeed ZeRO-3 on the same PEFT model.

Its results are benchmarks/results/lora_capacity.{json,md,png}, generated like capacity.* by
capacity_report.py; this module holds what differs: the modes, the model, the ladder and the
paragraphs the report computes (the targets of issue 13 among them).
"""
from __future__ import annotations

from capacity_report import GiB, Study, nvme_slope

DS_MODES = ("deepspeed-zero3", "deepspeed-zero3-lean", "deepspeed-zero3+cpu", "deepspeed-zero3+nvme")
# zerompi's mode and the DeepSpeed mode that keeps (or offloads) the base the same way: the headline pairs
PAIRS = (("stage3", "deepspeed-zero3"), ("stage3-lean", "deepspeed-zero3-lean"),
         ("stage3+cpu", "deepspeed-zero3+cpu"), ("stage3+nvme", "deepspeed-zero3+nvme"))
# Issue 13's targets: stage 3 fits >= 1.8x the base stage 0 fits; stage 3 + NVMe >= 4x DeepSpeed ZeRO-3
# (judged against DeepSpeed with NVMe offload too).
TARGET_STAGE3, TARGET_NVME = 1.8, 4.0


def _size(params: int) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio >= target else f"MISSED by {100 * (1 - ratio / target):.0f}%"


def _framework(data: dict, name: str) -> str:
    """``name`` and the version its trials reported: "zerompi 0.1.0"."""
    return next((r["framework"] for r in data["rows"] if r["ok"] and r["framework"].startswith(name + " ")), name)


def describe(data: dict) -> str:
    lora = next((r["lora_params"] for r in data["rows"] if r["ok"]), None)
    nvme = data["measurements"].get("stage3+nvme", {}).get("nvme_dir")
    return (f"Model: `transformers.LlamaForCausalLM`, hidden {data['hidden']}, intermediate {data['intermediate']}, "
            f"{data['heads']} heads ({data['kv_heads']} key/value heads), vocabulary {data['vocab']}, untied "
            f"embeddings; depth along the ladder {LORA.rungs(data['max_rungs'])}, bisected to about 10% after an "
            "OOM kill. The base is "
            f"frozen and held in bf16; `peft` LoRA r={data['lora_r']} (alpha {2 * data['lora_r']}) on the q, k, v, o, "
            "gate, up and down projections is all that trains"
            + (f" ({lora / 1e6:.1f}M parameters at the largest depth that trained first)" if lora else "")
            + f"; bf16 compute, AdamW on the adapters; one sequence of {data['seq']} random tokens per rank, "
            "2 steps. 'parameters' counts the frozen base. "
            f"{_framework(data, 'zerompi')}: the PEFT model built on the meta device and materialised "
            "one gather unit at a time by `initialize(..., param_init=...)`, as `jobs/finetune_lora.py` does; "
            "stage 0 replicates the frozen base, so there every rank first materialises its own bf16 copy, one "
            "module at a time (what loading `from_pretrained(dtype=torch.bfloat16)` on each rank gives); "
            "stage3+cpu and stage3+nvme offload parameters and optimizer state"
            + (f" (NVMe: zerompi's default swap settings on the machine's disk, `{nvme}`)" if nvme else "") + ". "
            f"DeepSpeed ({_framework(data, 'deepspeed')}, the peers venv): ZeRO-3 with `DS_ACCELERATOR=cpu` over "
            "gloo; the base built under `deepspeed.zero.Init(dtype=torch.bfloat16)`, so each module is partitioned "
            "as it is constructed and no rank holds the whole base; PEFT applied after it, `deepspeed.initialize` "
            "with bf16 and a torch AdamW. `deepspeed-zero3` keeps DeepSpeed's defaults for gathered parameters "
            "(`stage3_max_live_parameters` and `stage3_max_reuse_distance` 1e9, `stage3_prefetch_bucket_size` 5e7); "
            "`deepspeed-zero3-lean` sets all three to 0, so each module's parameters are released after use and "
            "nothing is prefetched: DeepSpeed's own advice when it runs out of memory. `deepspeed-zero3+cpu` and "
            "`deepspeed-zero3+nvme` take the lean settings (DeepSpeed's best here without offload) and set "
            "`offload_param` and `offload_optimizer` to `cpu` (unpinned) or to `nvme` (ZeRO-Infinity: the async I/O "
            "op, built against Debian's libaio-dev; parameter swap buffers of one embedding's size, 5 of them, "
            "`max_in_cpu` 0; the swap folder on the same disk as zerompi's), with "
            "`zero_force_ds_cpu_optimizer: false` so the same torch AdamW runs.")


def readings(data: dict) -> list[str]:
    best, out = data["best"], []
    params = {mode: b["params"] for mode, b in best.items()}
    s3 = [m for m in ("stage3", "stage3-lean") if m in params]
    if "stage0" in params and s3:
        top = max(s3, key=lambda m: params[m])
        r = params[top] / params["stage0"]
        out.append(f"Stage 3 fine-tunes a {r:.2f}× larger frozen base than stage 0 under the same cap at its best "
                   f"({top}; target ≥ {TARGET_STAGE3}×: {_verdict(r, TARGET_STAGE3)})"
                   + "".join(f"; {m} {params[m] / params['stage0']:.2f}×" for m in s3 if m != top)
                   + ": stage 0 keeps a whole bf16 copy of the base on every rank, stage 3 one shard of it per rank "
                   "plus the unit being gathered. stage3-lean is stage 3 with `return_freed_memory=True`: freed "
                   "blocks of 1 MiB or more go back to the OS instead of staying on glibc's heap for reuse, which "
                   "lowers the peak and costs page faults (s/step).")
    out += like_for_like(data)
    missing = [m for m in DS_MODES if m in data["measurements"] and m not in params]
    if missing:
        out.append(f"{', '.join(missing)} trained no depth at all; the end of each failed trial's output is "
                   "above.")
    ds_cpu = ("deepspeed-zero3+cpu", "deepspeed-zero3-lean")
    if "stage3" in params and "stage3+cpu" in params:
        out.append(f"'cpu' offload fits {params['stage3+cpu'] / params['stage3']:.2f}× what stage 3 fits. On this "
                   "machine the CPU is the device, so 'cpu' offload has nothing to move out of the memory the cap "
                   "counts; on a GPU node the same setting moves the frozen shards off the GPU."
                   + (f" DeepSpeed's 'cpu' offload fits {params[ds_cpu[0]] / params[ds_cpu[1]]:.2f}× what "
                      f"{ds_cpu[1]} fits." if set(ds_cpu) <= set(params) else ""))
    if "stage3+nvme" in best:
        text = ("With NVMe offload the frozen shards live in the swap files (2 bytes per base parameter in bf16, "
                "split over the ranks) and memory holds one gathered unit (plus one read ahead), the adapters and "
                "the swap buffers; what grows with the base is the time per step (each step reads the base twice, "
                "for forward and for backward) and the swap files.")
        slope = nvme_slope(data)
        if slope and slope[0] > 0:
            text += (f" The job's peak rises {slope[0]:.3f} bytes per base parameter across the NVMe rows; at that "
                     f"rate the cap would be reached near {_size(slope[1])} parameters.")
        out.append(text)
    return out


def _common_step(data: dict, a: str, b: str) -> str:
    """s/step of modes ``a`` and ``b`` at the largest depth both trained (the last step of each)."""
    step = {m: {r["n_layer"]: r["step_s"][-1] for r in data["rows"] if r["mode"] == m and r["ok"]} for m in (a, b)}
    both = set(step[a]) & set(step[b])
    if not both:
        return ""
    n = max(both)
    return (f"; at {n} layers, the deepest both trained, {step[a][n]:.1f} s/step against {step[b][n]:.1f} "
            f"({step[b][n] / step[a][n]:.2f}× zerompi's time)")


def like_for_like(data: dict) -> list[str]:
    """The headline: each zerompi mode against the DeepSpeed mode that offloads the same way."""
    best, ms = data["best"], data["measurements"]
    params = {mode: b["params"] for mode, b in best.items()}
    parts = []
    for z, d in PAIRS:
        if z not in params:
            continue
        if d not in ms:
            parts.append(f"{z} {_size(params[z])} against {d}: not measured in this file (a note below says why)")
            continue
        if d not in params:
            parts.append(f"{z} {_size(params[z])} against {d}: trained no depth (its error is above)")
            continue
        r = params[z] / params[d]
        bound = [m for m in (z, d) if best[m]["why"] != "OOM killed"]
        text = f"{z} {r:.2f}× {d} ({_size(params[z])} against {_size(params[d])}"
        if z == "stage3+nvme":
            text += f"; target ≥ {TARGET_NVME:g}×: {_verdict(r, TARGET_NVME)}"
        text += ")" + _common_step(data, z, d)
        if ms[z]["commit"] != ms[d]["commit"]:
            text += f" — measured at two commits ({z} at {ms[z]['commit']}, {d} at {ms[d]['commit']})"
        if bound:
            text += " — " + " and ".join(f"{m}'s ladder was not stopped by memory ({best[m]['why']})"
                                         for m in bound) + (", so its size is a lower bound" if len(bound) == 1 else
                                                            ", so both sizes are lower bounds")
        parts.append(text)
    if not parts:
        return []
    out = ["Like for like (each zerompi mode against the DeepSpeed mode that keeps or offloads the base the same way; "
           "s/step at a common depth, since the largest depths differ): " + "; ".join(parts) + "."]
    return out + ([_ds_note(params)] if all(m in params for m in DS_MODES[:2]) else [])


def _ds_note(params: dict) -> str:
    if all(m in params for m in DS_MODES[:2]):
        lean, default = params["deepspeed-zero3-lean"], params["deepspeed-zero3"]
        return (f"DeepSpeed's lean settings fit {lean / default:.2f}× its defaults: the defaults keep up to 1e9 "
                f"gathered elements ({2e9 / GiB:.1f} GiB in bf16) per rank from forward to backward.")
    return ""


LORA = Study(key="lora", stem="lora_capacity", worker="lora_worker.py",
             modes=("stage0", "stage3", "stage3-lean", "stage3+cpu", "stage3+nvme", *DS_MODES),
             ladder=(2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256),
             model={"hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000,
                    "lora_r": 8, "seq": 32},
             quick={"hidden": 256, "intermediate": 688, "heads": 4, "kv_heads": 2, "vocab": 1024,
                    "lora_r": 8, "seq": 32},
             title="Capacity: the largest frozen Llama-style base that LoRA-fine-tunes under one memory cap",
             describe=describe, readings=readings,
             x_label="frozen base parameters (millions, bf16), each point a run that trained",
             extra_sources=("jobs/finetune_lora.py", "benchmarks/lora_report.py", "benchmarks/peers/rowlib.py"),
             warm_up=DS_MODES)
