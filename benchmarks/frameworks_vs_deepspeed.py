"""The Hugging Face frameworks under zerompi's runner against the same scripts under real DeepSpeed, step by step.

    .venv/bin/python benchmarks/frameworks_vs_deepspeed.py [--steps 12] [--rows trainer-gpt2-zero2,...]
        [--out benchmarks/results/frameworks_vs_deepspeed] [--report-only]

Each row is one script at one ZeRO stage, run twice at ``--ranks`` ranks on the CPU with the same config, model,
data and seed: ``mpiexec -n 2 python -m zerompi.deepspeed SCRIPT ...`` and, for real DeepSpeed (0.19.8 here),
``mpiexec -n 2 python workers/ds_frameworks_launch.py SCRIPT ...``, a stand-in for DeepSpeed's launcher that
also gives Accelerate gloo where it finds no backend on a machine without CUDA (its docstring says what it
sets). The scripts are unchanged and know nothing of either:

* transformers' Trainer (tests/mpi/workers/hf_trainer.py, run_clm's shape: ``HfArgumentParser``, a causal LM
  ``from_pretrained``, ``Trainer.train``) with ``--deepspeed`` HF's "auto" config, GPT-2 and Llama at ZeRO-2/3;
* an Accelerate loop with ``DeepSpeedPlugin`` (workers/fw_accelerate.py), GPT-2 at ZeRO-2/3;
* TRL's SFTTrainer as ``trl/scripts/sft.py`` runs it (tests/mpi/workers/trl_sft.py), Llama and GPT-2 at ZeRO-3.

The models (2 layers, width 64, vocabulary 128) and the data are made locally first (trl_sft.py --make), fp32
throughout. Every step's loss (the logged mean over the ranks and the accumulation window) is recorded from
both; a row reports the largest difference and, for scale, fp32's unit in the last place at that loss.
Results, all generated: ``--out``.{jsonl,md}.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import launch, markdown, paths, rows, stamp  # noqa: E402

TESTS = paths.ROOT / "tests" / "mpi" / "workers"
SCRIPTS = {"trainer": TESTS / "hf_trainer.py", "accelerate": paths.WORKERS / "fw_accelerate.py",
           "trl": TESTS / "trl_sft.py"}
FRAMEWORKS = {"trainer": "transformers Trainer", "accelerate": "Accelerate + DeepSpeedPlugin",
              "trl": "TRL SFTTrainer"}
ROWS = [(fw, model, stage) for fw, model, stage in (
    ("trainer", "gpt2", 2), ("trainer", "gpt2", 3), ("trainer", "llama", 2), ("trainer", "llama", 3),
    ("accelerate", "gpt2", 2), ("accelerate", "gpt2", 3), ("trl", "llama", 3), ("trl", "gpt2", 3))]
AUTO = {"optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "weight_decay", "betas", "eps")}},
        **{k: "auto" for k in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                               "train_micro_batch_size_per_gpu")}, "bf16": {"enabled": "auto"}}
SIDES = ("zerompi", "deepspeed")
VERSIONS = ("deepspeed", "transformers", "accelerate", "trl", "datasets")


def key(fw: str, model: str, stage: int) -> str:
    return f"{fw}-{model}-zero{stage}"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rows", default=",".join(key(*r) for r in ROWS))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job before it is killed")
    p.add_argument("--out", type=Path, default=paths.RESULTS / "frameworks_vs_deepspeed", help="results prefix")
    p.add_argument("--report-only", action="store_true", help="rewrite the md from the existing jsonl")
    args = p.parse_args(argv)
    args.row_list = [r for r in ROWS if key(*r) in args.rows.split(",")]
    return args


def script_args(fw: str, model: str, stage: int, work: Path, out_dir: Path, steps: int) -> list[str]:
    """The script's own arguments: the same for both sides."""
    if fw == "accelerate":
        return [str(SCRIPTS[fw]), "--model_dir", str(work / model), "--stage", str(stage), "--steps", str(steps)]
    cfg = work / f"zero{stage}.json"
    common = ["--output_dir", str(out_dir), "--max_steps", str(steps), "--logging_steps", "1", "--report_to", "none",
              "--save_strategy", "no", "--train_sampling_strategy", "sequential", "--learning_rate", "3e-3",
              "--seed", "0", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
              "--deepspeed", str(cfg)]
    if fw == "trainer":
        return [str(SCRIPTS[fw]), "--model_dir", str(work / model), *common]
    return [str(SCRIPTS[fw]), "--model_name_or_path", str(work / model), "--dataset_name", str(work / "data"),
            "--bf16", "false", *common]


def command(side: str, ranks: int, args: list[str]) -> list[str]:
    if side == "zerompi":
        return launch.mpi_command(ranks, "-m", "zerompi.deepspeed", *args, abort_on_error=False)
    return launch.mpi_command(ranks, paths.WORKERS / "ds_frameworks_launch.py", *args)


def env(work: Path) -> dict:
    """No download; a datasets cache of this run's own."""
    return launch.job_env(mpich_yield=True, extra={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                                   "HF_DATASETS_CACHE": str(work / "cache"),
                                                   "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"})


def prepare(work: Path) -> None:
    """The models, tokenizers and data (trl_sft.py --make), and the two DeepSpeed configs."""
    launch.run([sys.executable, str(SCRIPTS["trl"]), "--make", str(work)], env=env(work), timeout=600).check()
    for stage in (2, 3):
        zero = {"stage": stage, **({"stage3_gather_16bit_weights_on_model_save": True} if stage == 3 else {})}
        (work / f"zero{stage}.json").write_text(json.dumps({**AUTO, "zero_optimization": zero}))


def ulp32(x: float) -> float:
    """fp32's unit in the last place at ``x``."""
    exponent = math.frexp(abs(x))[1] - 1  # x = m * 2**exponent with 1 <= m < 2
    return 2.0 ** (exponent - 23)


def compare(runs: dict) -> dict:
    """The per-step differences of the two sides' losses (and gradient norms, where logged)."""
    ours, theirs = runs["zerompi"]["losses"], runs["deepspeed"]["losses"]
    diffs = [abs(a - b) for a, b in zip(ours, theirs)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    out = dict(steps=len(diffs), steps_each=[len(ours), len(theirs)], max_diff=diffs[worst], max_diff_step=worst + 1,
               loss_at=theirs[worst], ulp=ulp32(theirs[worst]), max_diff_ulps=diffs[worst] / ulp32(theirs[worst]),
               first_loss=theirs[0], last_loss=theirs[-1])
    if "grad_norms" in runs["zerompi"] and "grad_norms" in runs["deepspeed"]:
        rel = [abs(a - b) / abs(b) for a, b in zip(runs["zerompi"]["grad_norms"], runs["deepspeed"]["grad_norms"])]
        out["max_grad_norm_rel"] = max(rel)
    return out


def run_row(fw: str, model: str, stage: int, args, work: Path) -> dict:
    row = dict(row=key(fw, model, stage), framework=fw, model=model, stage=stage, ranks=args.ranks)
    runs = {}
    for side in SIDES:
        out = work / f"{key(fw, model, stage)}-{side}.json"
        cmd = command(side, args.ranks, [*script_args(fw, model, stage, work, work / "out" / side, args.steps),
                                         "--out", str(out)])
        outcome = launch.run(cmd, env=env(work), timeout=args.timeout)
        row[side] = outcome.record()
        if outcome.ok:
            runs[side] = json.loads(out.read_text())
            row[side].update(runs[side])
        print(f"{row['row']} {side}: {outcome.status.value} in {outcome.wall_s:.0f} s", flush=True)
    if len(runs) == 2:
        row.update(compare(runs))
    return row


def measure(args) -> None:
    meta = dict(benchmark="frameworks_vs_deepspeed", steps=args.steps, ranks=args.ranks,
                rows=[key(*r) for r in args.row_list], versions={d: stamp.version(d) for d in VERSIONS})
    with tempfile.TemporaryDirectory(prefix="fw-vs-ds-") as tmp, \
            rows.RowLog(args.out.with_suffix(".jsonl"), meta) as log:
        work = Path(tmp)
        prepare(work)
        for fw, model, stage in args.row_list:
            log.add(run_row(fw, model, stage, args, work))


def report(path: Path) -> str:
    meta, found = rows.split(rows.read(path))
    head = ["row", "framework", "model", "ZeRO", "steps compared", "largest abs. loss difference (step)",
            "fp32 ulp at that loss", "in ulps", "largest rel. grad-norm difference"]
    body = []
    for r in found:
        if "max_diff" not in r:
            why = "; ".join(f"{s}: {markdown.short_error(r[s])}" for s in SIDES if r[s].get("status") != "ok")
            body.append([r["row"], FRAMEWORKS[r["framework"]], r["model"], r["stage"], "—", why, "", "", ""])
            continue
        grad = f"{r['max_grad_norm_rel']:.1e}" if "max_grad_norm_rel" in r else "not logged"
        body.append([r["row"], FRAMEWORKS[r["framework"]], r["model"], r["stage"], r["steps"],
                     f"{r['max_diff']:.2e} (step {r['max_diff_step']}, loss {r['loss_at']:.4f})",
                     f"{r['ulp']:.2e}", f"{r['max_diff_ulps']:.1f}", grad])
    st = found[0]["stamp"] if found else meta.get("stamp", {})
    versions = ", ".join(f"{d} {v}" for d, v in meta.get("versions", {}).items())
    lines = ["# Hugging Face frameworks: zerompi's runner against real DeepSpeed", "",
             f"Generated by `benchmarks/frameworks_vs_deepspeed.py` (commit {st.get('commit', '?')[:10]}"
             f"{', dirty tree' if st.get('dirty') else ''}, {st.get('utc', '?')}); machine: "
             f"{stamp.machine_line()}; torch {st.get('versions', {}).get('torch')}, {versions}.", "",
             f"Each row runs one unchanged script at {meta.get('ranks')} ranks on the CPU for {meta.get('steps')} "
             "optimizer steps (2 micro-batches of 2 rows per rank and step, fp32), once under "
             "`mpiexec -n 2 python -m zerompi.deepspeed SCRIPT` and once under real DeepSpeed, with the same "
             "config, model, data and seed, and compares the logged loss of every step.", "",
             "**The DeepSpeed side is a stand-in launch**, since DeepSpeed's own launcher and Accelerate expect "
             "CUDA: `benchmarks/workers/ds_frameworks_launch.py` sets each rank's `RANK`, `LOCAL_RANK`, "
             "`WORLD_SIZE`, `LOCAL_WORLD_SIZE` and a rendezvous port from MPI, `DS_ACCELERATOR=cpu`, and gives "
             "Accelerate gloo where it finds no torch.distributed backend for a DeepSpeed run (without it each "
             "rank would train alone). DeepSpeed's own code runs unchanged: its engine, ZeRO-2/3, its FusedAdam "
             "CPU op and `zero.Init`.", "",
             *markdown.table(head, body),
             "The ulp column is fp32's spacing at the loss where the difference is largest: a difference of a "
             "few ulps is the two implementations summing the same fp32 numbers in another order (buckets, "
             "reductions, the norm for clipping), which Adam then carries into later steps.", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.report_only:
        measure(args)
    markdown.write(args.out.with_suffix(".md"), report(args.out.with_suffix(".jsonl")))


if __name__ == "__main__":
    main()
