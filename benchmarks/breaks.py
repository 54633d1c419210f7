"""The deliberate one-line breaks that once passed the suite, each applied alone: the test that now fails.

Issue 52 listed nine breaks of guarantees that no test failed. Each now has a test in the fast tier (the
fifth, a Lightning epoch that ends inside an accumulation window, too: test_lightning_compat.py runs
Lightning's Trainer in one process). This script applies each break to a copy of HEAD (benchmarks/mutation.py's
copy and runner), runs the tests named beside it, and writes which test failed and how long the run took to
``results/breaks.md``; the unbroken tree's run of the same tests comes first, as the control.

    .venv/bin/python benchmarks/breaks.py [--only 1,6]
"""
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import mutation  # noqa: E402
from harness import stamp  # noqa: E402


@dataclass(frozen=True)
class Break:
    what: str
    module: str
    old: str
    new: str
    tests: tuple[str, ...]


BREAKS = [
    Break("stage 3's gather units each restart the owner load count (Muon's matrices all on rank 0)",
          "zerompi/shard/planning.py", "frozenset(), loads=loads, trainable", "frozenset(), loads={}, trainable",
          ("tests/unit/optim/test_whole.py::test_matrix_owners_are_balanced_over_every_bucket_and_unit",)),
    Break("hang records sent to rank 0 only, not to the deputy", "zerompi/comm/watchdog.py",
          "for to in {0, DEPUTY} - {self.rank}:", "for to in {0} - {self.rank}:",
          ("tests/unit/comm/test_hang.py::test_the_deputy_has_every_record_at_three_ranks",)),
    Break("`seed` added to the keys that may differ between ranks", "zerompi/shard/agreement.py",
          'PER_RANK = frozenset({"cpu_threads",', 'PER_RANK = frozenset({"seed", "cpu_threads",',
          ("tests/unit/shard/test_agreement.py::test_per_rank_is_the_reviewed_set",)),
    Break("a gather in flight reported AVAILABLE, not INFLIGHT", "zerompi/compat/deepspeed/param_status.py",
          "BucketState.GATHERING: ZeroParamStatus.INFLIGHT", "BucketState.GATHERING: ZeroParamStatus.AVAILABLE",
          ("tests/unit/deepspeed/test_param_status.py::test_a_gather_started_ahead_is_inflight",)),
    Break("the Lightning strategy's refusal when its window and the engine's disagree removed",
          "zerompi/compat/lightning/strategy.py",
          "if module.automatic_optimization and self.engine.iteration.idle ==",
          "if False and self.engine.iteration.idle ==",
          ("tests/unit/test_lightning_compat.py::test_an_epoch_that_ends_inside_a_window_is_refused",)),
    Break("the fixed pairwise tree of chunk sums replaced by sum(dim=1)", "zerompi/shard/grads.py",
          "        while sums.shape[1] > 1:\n", "        sums = sums.sum(dim=1, keepdim=True)\n        while False:\n",
          ("tests/unit/shard/test_chunk_sum.py::test_chunk_sums_are_the_pairwise_tree_bit_for_bit",)),
    Break("an asynchronous save packs whole-tensor optimizer state lazily, on the writer thread",
          "zerompi/checkpoint/tensors.py", "return HostCopy(tuple(self.parts()))", "return HostCopy(self.parts())",
          ("tests/unit/checkpoint/test_async_whole.py",)),
    Break("the runner no longer forgets a real DeepSpeed imported before the alias",
          "zerompi/compat/deepspeed/runner.py", "            del sys.modules[name]  # a real DeepSpeed",
          "            pass  # a real DeepSpeed",
          ("tests/unit/deepspeed/test_deepspeed_surface.py"
           "::test_the_runner_forgets_a_real_deepspeed_imported_before_it",)),
    Break("the fork server no longer compares a rank's import-time environment", "tests/mpi/forkserver.py",
          'return all(env.get(k) == STARTED_WITH.get(k) for k in keys - {"PYTHONPATH"}) and _path_fits(env)',
          "return _path_fits(env)",
          ("tests/unit/tools/test_forkserver.py::test_omp_num_threads_takes_effect_in_the_rank",
           "tests/unit/tools/test_forkserver.py::test_pythonhashseed_takes_effect_in_the_rank")),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated break numbers (1-based)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "breaks.md")
    args = p.parse_args()
    chosen = [(i, b) for i, b in enumerate(BREAKS, 1) if not args.only or str(i) in args.only.split(",")]
    tree = mutation.make_copy(working_tree=False)
    rows, started = [], stamp.utc_now()
    try:
        control, _, took = mutation.run_tests(tree, sorted({t for _, b in chosen for t in b.tests}), None, False)
        control = "passed" if control == "survived" else f"{control} (the breaks below mean nothing)"
        print(f"control: {control} in {took:.1f} s", file=sys.stderr)
        for i, b in chosen:
            path = tree / b.module
            source = path.read_bytes()
            text = source.decode()
            if text.count(b.old) != 1:
                rows.append((i, b, "not applied", f"the line is not found once in {b.module}", 0.0))
                continue
            mutation.apply(tree, b.module, text.replace(b.old, b.new).encode())
            verdict, failed, took = mutation.run_tests(tree, list(b.tests), 600)
            mutation.apply(tree, b.module, source)
            rows.append((i, b, verdict, failed, took))
            print(f"[{i}] {b.what}: {verdict} {failed} ({took:.1f} s)", file=sys.stderr)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    lines = ["# Issue 52's nine breaks, each applied alone", "",
             f"`benchmarks/breaks.py` at commit {stamp.commit(short=True)}, {started}, load "
             f"{stamp.loadavg()[0]:.1f} at the end. Unbroken, the same tests: {control}.", "",
             "| # | break | module | verdict | the test that failed | seconds |", "|---|---|---|---|---|---|"]
    for i, b, verdict, failed, took in rows:
        lines.append(f"| {i} | {b.what} | `{b.module}` | {verdict} | `{failed}` | {took:.1f} |")
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
