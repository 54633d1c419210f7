"""Where a benchmark row's step time goes: py-spy samples of every rank, split by what runs.

    benchmarks/.venv-peers/bin/python benchmarks/profile_rows.py --rows zerompi-3,fsdp2 [--size 20M --np 2]

Each row of bench_peers.py runs under ``py-spy record --idle`` (every rank, 100 samples/s,
Python frames). Only samples taken inside the timed steps count (frames under rowlib's
``_timed_loop``). A sample is charged to the innermost frame that belongs to a known part:

- communication: zerompi/comm/ (mpi.py, group.py, thread.py), torch.distributed's c10d calls and
  FSDP's collectives, deepspeed/comm (time in MPI or gloo, waits included);
- framework: the rest of zerompi (hooks, buckets, copies), FSDP, DeepSpeed, DDP's reducer
  calls from Python;
- optimizer: torch/optim;
- compute: the model's forward (torch/nn) and the autograd engine's backward.

The split is of the main thread's time (waits included), averaged over ranks, so its seconds
add up to about the step time. Results go to ``benchmarks/results/profile.md`` (and .jsonl).
Needs ``py-spy`` in the peers venv (``pip install py-spy``) and ptrace rights.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_peers  # noqa: E402
from harness import launch, markdown, rows  # noqa: E402

# innermost-first: the first part whose marker is in a frame's file takes the sample
PARTS = (
    ("communication", ("zerompi/comm/mpi.py", "zerompi/comm/group.py", "zerompi/comm/thread.py",
                       "distributed/distributed_c10d.py", "_fsdp_collectives.py", "deepspeed/comm/",
                       "distributed/c10d_logger.py")),
    # the benchmark's model lives in zerompi/models, and DeepSpeed ZeRO-3 swaps F.linear for its
    # own autograd function: both are the model's compute, not framework
    ("compute", ("zerompi/models/", "deepspeed/runtime/zero/linear.py")),
    ("framework", ("zerompi/", "distributed/fsdp/", "deepspeed/", "nn/parallel/distributed.py",
                   "distributed/optim/")),
    ("optimizer", ("torch/optim/",)),
    ("compute", ("torch/nn/", "torch/autograd/", "torch/_tensor.py", "torch/utils/")),
)
PART_NAMES = list(dict.fromkeys(p for p, _ in PARTS)) + ["other"]


def classify(stack: list[str]) -> tuple[str, str]:
    """The part and the frame that took a sample.

    ``stack``: frames root first, as py-spy's raw format writes them ("func (file:line)").
    """
    for frame in reversed(stack):
        for part, markers in PARTS:
            if any(m in frame for m in markers):
                return part, frame
    return "other", stack[-1] if stack else "?"


def split_samples(raw: str) -> tuple[collections.Counter, collections.Counter]:
    """Samples per part and per (part, frame), counting only those taken inside the timed steps."""
    parts: collections.Counter = collections.Counter()
    frames: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit() or "_timed_loop" not in stack_text:
            continue
        stack = stack_text.split(";")
        timed = next(i for i, f in enumerate(stack) if "_timed_loop" in f)
        part, frame = classify(stack[timed + 1:])
        parts[part] += int(count)
        frames[(part, frame)] += int(count)
    return parts, frames


def profile_row(row, size: str, np_: int, args, mpiexec: str, spy: str, rate: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"prof-{row.key}-"))
    wrapper = work / "spy.sh"
    # one profile file per rank; the rank comes from the launcher's environment
    wrapper.write_text("#!/bin/sh\nr=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}\n"
                       f'exec {spy} record --idle --rate {rate} --format raw --nonblocking '
                       f'-o {work}/rank$r.txt -- "$@" >/dev/null 2>&1\n')
    wrapper.chmod(0o755)
    result = bench_peers.run_row(row, size, np_, args, mpiexec, prefix=[str(wrapper)])
    per_rank = [split_samples(p.read_text()) for p in sorted(work.glob("rank*.txt"))]
    shutil.rmtree(work, ignore_errors=True)
    total, frames = collections.Counter(), collections.Counter()
    for parts, fr in per_rank:
        total.update(parts)
        frames.update(fr)
    n = sum(total.values())
    top = {part: [(f, c / n) for (p, f), c in frames.most_common() if p == part][:6] for part in PART_NAMES}
    step = result.get("step_s_median")
    share = {p: total[p] / n if n else 0.0 for p in PART_NAMES}
    return dict(row=row.key, label=row.label, size=size, np=np_, status=result["status"], step_s_median=step,
                samples=n, ranks_profiled=len(per_rank), share=share,
                seconds_per_step={p: share[p] * step for p in PART_NAMES} if step else None, top_frames=top)


def report(rows: list[dict]) -> str:
    lines = ["# Where the step time goes", "",
             "py-spy samples of every rank's main thread during the timed steps (waits included), "
             "charged to the innermost known part; seconds = share x median step time. "
             "Made by `benchmarks/profile_rows.py`; its docstring says what each part holds. "
             "py-spy slows Python a little, so the step times here are above bench_peers' figures.", "",
             "| row | size | np | step s | " + " | ".join(PART_NAMES) + " | samples |",
             "|---|---|---|---|" + "---|" * len(PART_NAMES) + "---|"]
    for r in rows:
        if r["status"] != "ok" or not r["seconds_per_step"]:
            lines.append(f"| {r['label']} | {r['size']} | {r['np']} | {r['status']} |" + " |" * (len(PART_NAMES) + 1))
            continue
        cells = [f"{r['seconds_per_step'][p]:.2f} ({100 * r['share'][p]:.0f}%)" for p in PART_NAMES]
        lines.append(f"| {r['label']} | {r['size']} | {r['np']} | {r['step_s_median']:.2f} | "
                     + " | ".join(cells) + f" | {r['samples']} |")
    lines += ["", "Frames taking the most samples outside the model's compute (share of the row's samples):", ""]
    for r in rows:
        if r["status"] != "ok":
            continue
        lines.append(f"- {r['label']}:")
        for part in ("communication", "framework", "optimizer", "other"):
            frames = ", ".join(f"`{f}` {100 * c:.1f}%" for f, c in r["top_frames"][part][:3])
            if frames:
                lines.append(f"  - {part}: {frames}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="zerompi-3,fsdp2,ds-3")
    p.add_argument("--size", default="20M")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rate", type=int, default=100, help="samples per second per rank")
    p.add_argument("--out", default=str(HERE / "results" / "profile"))
    p.add_argument("--reading", help="a markdown file with the reading, appended to the report")
    args = p.parse_args(argv)
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy not found: pip install py-spy into this venv")
    peer_args = bench_peers.parse_args(["--rows", args.rows, "--steps", str(args.steps),
                                        "--warmup", str(args.warmup)])
    mpiexec = launch.find_mpiexec(None)
    out = Path(args.out)
    with rows.RowLog(out.with_suffix(".jsonl")) as log:
        for row in peer_args.row_list:
            r = log.add(profile_row(row, args.size, args.np, peer_args, mpiexec, spy, args.rate))
            print(json.dumps({k: v for k, v in r.items() if k != "stamp"}), flush=True)
    text = report(log.rows)
    if args.reading:
        text += "\n## Reading\n\n" + markdown.reading(args.reading)
    markdown.write(out.with_suffix(".md"), text)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    main()
