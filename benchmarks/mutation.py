"""Mutation testing: small changes to one module, and whether the tests that cover it notice.

    .venv/bin/python benchmarks/mutation.py zerompi/optim/kinds.py [--tests T [T ...]] [--jobs N]
        [--timeout S] [--working-tree] [--mutants 3,17] [--out PATH]

Each mutant is one small change at the positions ``ast`` gives (the rest of the file stays byte for byte):

- comparison flipped: ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``in`` <-> ``not in``,
  ``is`` <-> ``is not``
- arithmetic swapped (also in ``+=``-style statements): ``+`` <-> ``-``, ``*`` <-> ``/``, ``//`` <-> ``%``
- boolean swapped: ``and`` <-> ``or``; ``not`` removed
- constant changed: ``0`` <-> ``1``, ``True`` <-> ``False``, any other number ``n`` -> ``n + 1``
- ``return x`` -> ``return None``; a statement in a function body -> ``pass`` (not a ``def``/``class``,
  not ``return x``, which the previous covers)
- a condition negated: ``if``, ``elif``, ``while``, ``x if c else y`` and comprehension ``if``s
- slice bounds shifted: ``a[lo:hi]`` -> ``a[lo + 1:hi]`` and ``a[lo:hi - 1]``

Docstrings, annotations and f-strings are left alone; a mutant that does not compile is skipped and counted.

Each job works in its own copy of the tree in a temporary directory: ``git archive HEAD`` (the default: the
run is of a commit), or with ``--working-tree`` the working tree's tracked and untracked, not ignored, files.
The checkout itself is never written, except the report. The copy comes first on ``PYTHONPATH`` (the run
checks that ``zerompi`` imports from it), the covering tests first run unmutated (they must pass; their time
sets the default timeout, ``5 x baseline + 30 s``, loose because other work may slow one run), then once per
mutant with ``-x -q -p no:cacheprovider``; a failure kills the mutant, a run past the timeout counts as
killed and is reported apart.

Covering tests: ``--tests``, or else the COVERING table below, or else the rule
``zerompi/<pkg>/<name>.py -> tests/unit/<pkg>/test_<name>.py`` when that file exists. Fast unit tests
first; a module whose tests are MPI jobs (``tests/mpi/``, each runs mpiexec) lists them here explicitly.

Report: ``benchmarks/results/mutation-<module>.md`` (``zerompi/optim/kinds.py`` -> ``mutation-optim-kinds.md``),
one file per module, so runs of different modules never write the same file. Its survivors table has a
verdict column written by hand ("equivalent: <why>", or "killed by <test> after <fix>"); a re-run keeps
each verdict beside its mutant (matched by line and text) and says what the mutant does now.
``--mutants 3,17`` runs only those mutants (numbered as in the log) and prints, writing no report.
"""
from __future__ import annotations

import argparse
import ast
import io
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COVERING = {  # module -> the tests that cover it
    "zerompi/optim/kinds.py": ["tests/unit/optim/test_kinds.py"],
    "zerompi/checkpoint/tensors.py": ["tests/unit/checkpoint/test_tensor_states.py", "tests/unit/optim/test_whole.py",
                                      "tests/unit/checkpoint/test_async_whole.py",
                                      "tests/unit/checkpoint/test_tensor_records.py"],
    "zerompi/checkpoint/held.py": ["tests/unit/checkpoint/test_replica.py", "tests/unit/checkpoint/test_held.py"],
    "zerompi/shard/agreement.py": ["tests/unit/shard/test_agreement.py", "tests/unit/shard/test_model_agreement.py"],
    "zerompi/compat/deepspeed/param_status.py": ["tests/unit/deepspeed/test_param_status.py",
                                                 "tests/unit/deepspeed/test_param_status_kinds.py"],
    # a bucket's collectives and storage: the one-rank verb tests, then prefetch, rounds and ds_status at 2 ranks
    "zerompi/shard/collectives.py": ["tests/unit/shard/test_bucket_self.py", "tests/unit/shard/test_prefetch.py",
                                     "tests/unit/shard/test_rounds.py", "tests/unit/deepspeed/test_param_status.py",
                                     "tests/unit/test_engine_self.py"],
    "zerompi/shard/bucket.py": ["tests/unit/shard/test_bucket_self.py", "tests/unit/shard/test_prefetch.py",
                                "tests/unit/shard/test_rounds.py", "tests/unit/test_engine_self.py"],
    # stage 3's unit schedule: prefetch order and depth, the rounds' replay, release, gathers outside a forward
    "zerompi/shard/schedule.py": ["tests/unit/shard/test_prefetch.py", "tests/unit/shard/test_rounds.py",
                                  "tests/unit/shard/test_freed_memory.py", "tests/unit/shard/test_outside_a_gather.py",
                                  "tests/unit/test_engine_self.py", "tests/unit/offload/test_swap_traffic.py"],
    # the report again from a job's records: which report, the settling wait, --if-unreported, no DIR
    "zerompi/tools/diagnose.py": ["tests/unit/comm/test_ends.py", "tests/unit/comm/test_hang.py", "-k", "diagnose"],
    # every engine plans its buckets here: the layout, deferred-build, prefetch and owner-placement tests
    "zerompi/shard/planning.py": ["tests/unit/shard/test_planning.py", "tests/unit/shard/test_layout.py",
                                  "tests/unit/shard/test_deferred.py",
                                  "tests/unit/shard/test_prefetch.py", "tests/unit/optim/test_whole.py",
                                  "tests/unit/test_engine_self.py", "tests/unit/shard/test_initial_values.py"],
    # the report's rules and text; test_hang.py's watchdog tests (threads, seconds of waiting) left out
    "zerompi/comm/diagnosis.py": ["tests/unit/comm/test_report_text.py", "tests/unit/comm/test_hang.py", "-k",
                                  "not (deputy or watchdog or overdue or unwritable or raising or moves_forever "
                                  "or whose_report or rank_0_sends)"],
    # the alias and the launcher's environment: unit tests in one process, then 2-rank jobs
    "zerompi/compat/deepspeed/runner.py": ["tests/unit/deepspeed/test_deepspeed_surface.py",
                                           "tests/unit/deepspeed/test_runner_alias.py",
                                           "tests/mpi/test_ds_launcher_env.py", "tests/mpi/test_runner.py"],
    "zerompi/compat/lightning/strategy.py": ["tests/unit/test_lightning_compat.py", "tests/unit/test_lightning_parts.py",
                                             "tests/unit/test_lightning_fit.py"],
}

SWAPS = {  # operator -> (its text, the mutant's)
    ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"), ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"), ast.NotIn: ("not in", "in"), ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"), ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "/"), ast.Div: ("/", "*"),
    ast.FloorDiv: ("//", "%"), ast.Mod: ("%", "//"), ast.And: ("and", "or"), ast.Or: ("or", "and")}
KEPT = (ast.Pass, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Global, ast.Nonlocal)


def _docstring(node: ast.AST) -> bool:  # or any bare string statement
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


@dataclass
class Mutant:
    number: int
    line: int
    kind: str
    original: str  # the line it changes (or its part around the change), on one line
    mutated: str  # the same, mutated
    source: bytes  # the whole mutated module
    outcome: str = ""  # killed, timeout or survived
    by: str = ""  # the first failing test


class Mutator:
    """Every mutant of one module's source: (start, stop, replacement, kind), splicing bytes only where the
    change is (an operator, a constant, a condition, a statement), so the rest keeps its text."""

    def __init__(self, source: bytes):
        self.data, self.starts, self.found = source, [0], []
        for line in source.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))  # ast's columns are utf-8 byte offsets

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.starts[node.lineno - 1] + node.col_offset, self.starts[node.end_lineno - 1] + node.end_col_offset

    def text(self, node: ast.AST) -> str:
        a, b = self.span(node)
        return self.data[a:b].decode()

    def add(self, node: ast.AST, kind: str, replacement: str) -> None:
        self.found.append((*self.span(node), replacement, kind))

    def swap(self, left: ast.AST, right: ast.AST, old: str, new: str, kind: str) -> None:
        """The operator ``old`` between two operands (outside any parentheses of theirs) made ``new``."""
        a, b = self.span(left)[1], self.span(right)[0]
        gap = self.data[a:b].decode()
        i = re.search(rf"(?<![\w=<>!/*]){re.escape(old)}(?![\w=<>!/*])", gap.split("#")[0])
        if i:
            self.found.append((a + len(gap[:i.start()].encode()), a + len(gap[:i.end()].encode()), new, kind))

    def negate(self, test: ast.expr) -> None:
        if not (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)):  # else: "not removed" covers it
            self.add(test, "condition negated", f"(not ({self.text(test)}))")

    def visit(self, node: ast.AST, in_def: bool = False) -> None:
        if isinstance(node, ast.JoinedStr):
            return
        self.mutate(node, in_def)
        in_def = in_def or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for field, value in ast.iter_fields(node):
            if field in ("annotation", "returns"):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST) and not _docstring(child):
                    self.visit(child, in_def)

    def mutate(self, node: ast.AST, in_def: bool) -> None:
        if isinstance(node, ast.Compare):
            for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators):
                self.swap(left, right, *SWAPS[type(op)], "comparison")
        elif isinstance(node, ast.BinOp) and type(node.op) in SWAPS:
            self.swap(node.left, node.right, *SWAPS[type(node.op)], "arithmetic")
        elif isinstance(node, ast.AugAssign) and type(node.op) in SWAPS:
            self.swap(node.target, node.value, *(op + "=" for op in SWAPS[type(node.op)]), "arithmetic")
        elif isinstance(node, ast.BoolOp):
            for left, right in zip(node.values, node.values[1:]):
                self.swap(left, right, *SWAPS[type(node.op)], "boolean")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self.swap(node, node.operand, "not", "", "not removed")  # the gap from the node's start to its operand
        elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
            v = node.value
            new = not v if type(v) is bool else 1 - v if type(v) is int and v in (0, 1) else v + 1
            self.add(node, "constant", repr(new))
        elif isinstance(node, ast.Slice):
            if node.lower is not None:
                self.add(node.lower, "slice bound", f"({self.text(node.lower)}) + 1")
            if node.upper is not None:
                self.add(node.upper, "slice bound", f"({self.text(node.upper)}) - 1")
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            self.negate(node.test)
        elif isinstance(node, ast.comprehension):
            for test in node.ifs:
                self.negate(test)
        if isinstance(node, ast.Return) and node.value is not None:
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                self.add(node.value, "return None", "None")
        elif in_def and isinstance(node, ast.stmt) and not isinstance(node, KEPT):
            self.add(node, "statement removed", "pass")


def shown(data: bytes, a: int, b: int, width: int = 45) -> str:
    """The lines holding data[a:b], at most ``width`` bytes either side of it, on one line."""
    lo, hi = max(data.rfind(b"\n", 0, a) + 1, a - width), data.find(b"\n", b)
    hi = min(len(data) if hi < 0 else hi, b + width)
    text = " ".join(data[lo:hi].decode(errors="replace").split())
    return ("…" if lo > data.rfind(b"\n", 0, a) + 1 else "") + (text if len(text) <= 120 else text[:119] + "…")


def mutants(source: bytes, path: str) -> tuple[list[Mutant], int]:
    """(the module's compiling mutants, numbered from 1 in source order; how many did not compile)."""
    (mutator := Mutator(source)).visit(ast.parse(source))
    out, seen, broken = [], {source}, 0
    for a, b, replacement, kind in sorted(mutator.found, key=lambda f: f[:2]):
        new = source[:a] + replacement.encode() + source[b:]
        if new in seen:
            continue
        seen.add(new)
        try:
            compile(new, path, "exec", dont_inherit=True)
        except SyntaxError:
            broken += 1
            continue
        end, line = b + len(new) - len(source), source.count(b"\n", 0, a) + 1
        out.append(Mutant(len(out) + 1, line, kind, shown(source, a, b), shown(new, a, end), new))
    return out, broken


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def make_copy(working_tree: bool) -> Path:
    tree = Path(tempfile.mkdtemp(prefix="zerompi-mutation-"))
    if not working_tree:
        data = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            archive.extractall(tree, filter="data")
        return tree
    for name in git("ls-files", "-z", "-c", "-o", "--exclude-standard").split("\0"):
        src = ROOT / name
        if name and src.is_file():  # tracked files deleted in the working tree are left out
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / name)
    return tree


def test_env(tree: Path, mutated: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    if mutated:  # no .pyc of a mutant: the next mutant's source can have the same size and mtime second
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_tests(tree: Path, tests: list[str], timeout: float | None, mutated: bool = True) -> tuple[str, str, float]:
    """(killed, timeout or survived; the first failing test; seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                            cwd=tree, env=test_env(tree, mutated), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the test run's own process group, mpiexec included
        proc.communicate()
        return "timeout", "", time.monotonic() - start
    took = time.monotonic() - start
    if proc.returncode == 0:
        return "survived", "", took
    failed = re.search(r"^(?:FAILED|ERROR) (\S+\[.*?\](?= - |$)|\S+)", out, re.MULTILINE)  # the node id
    return "killed", failed[1] if failed else f"exit {proc.returncode}: {' '.join(out[-200:].split())}", took


def apply(tree: Path, module: str, source: bytes) -> None:
    path = tree / module
    for stale in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
        stale.unlink()
    path.write_bytes(source)


def covering(module: str) -> list[str]:
    if module in COVERING:
        return COVERING[module]
    parts = Path(module).parts
    guess = Path("tests/unit", *parts[1:-1], f"test_{Path(module).stem}.py")
    if parts[0] == "zerompi" and (ROOT / guess).is_file():
        return [str(guess)]
    sys.exit(f"no covering tests known for {module}: pass --tests, or add it to COVERING in {__file__}")


def report_path(module: str) -> Path:
    return ROOT / "benchmarks" / "results" / f"mutation-{'-'.join(Path(module).with_suffix('').parts[1:])}.md"


def cell(text: str) -> str:
    return f"`{text.replace('`', chr(39))}`".replace("|", "\\|")


def old_verdicts(path: Path) -> dict[tuple[str, str, str], str]:
    """The hand-written verdicts of a previous report, by (line, original, mutated) cells."""
    found, inside = {}, False
    for line in path.read_text().splitlines() if path.is_file() else []:
        inside = line.startswith("## Survivors") if line.startswith("## ") else inside
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if inside and len(cells) == 7 and cells[0].isdigit():
            found[cells[1], cells[3], cells[4]] = cells[6]
    return found


@dataclass
class Run:
    """What a report says of its run besides the mutants."""
    module: str
    tests: list[str]
    command: str
    tree: str  # "commit abc1234", or the working tree at it
    load: float  # as the run began: other work shares the CPUs, and the times with it
    size: int = 0  # the module's lines
    broken: int = 0  # mutants that did not compile
    baseline: float = 0.0  # seconds: the tests, unmutated
    timeout: float = 0.0
    wall: float = 0.0


def report(path: Path, run: Run, ms: list[Mutant]) -> None:
    verdicts = old_verdicts(path)
    counts = Counter(m.outcome for m in ms)
    rows = [m for m in ms if m.outcome == "survived" or (str(m.line), cell(m.original), cell(m.mutated)) in verdicts]
    verdict = {m.number: verdicts.get((str(m.line), cell(m.original), cell(m.mutated)), "") for m in rows}
    alive = Counter("equivalent" if verdict[m.number].startswith("equivalent") else "other" if verdict[m.number]
                    else "none" for m in rows if m.outcome == "survived")
    lines = [
        f"# Mutation testing: `{run.module}`", "",
        (f"Made by `{run.command}` (its docstring says what it does), {run.tree}, {datetime.now(UTC):%Y-%m-%d %H:%M}"
         f" UTC, on {os.cpu_count()} CPUs (load average {run.load:.1f} as it began: the times depend on it)."), "",
        "| | |", "|---|---|",
        f"| module | `{run.module}` ({run.size} lines) |",
        f"| tests | {', '.join(f'`{t}`' for t in run.tests)} (unmutated: {run.baseline:.1f} s) |",
        f"| mutants | {len(ms)} ({run.broken} more did not compile and were skipped) |",
        (f"| killed | {counts['killed'] + counts['timeout']}, of which {counts['timeout']} by the timeout "
         f"({run.timeout:.0f} s) |"),
        (f"| survived | {counts['survived']}: argued equivalent {alive['equivalent']}, another verdict "
         f"{alive['other']}, without a verdict yet {alive['none']} |"),
        f"| wall time | {run.wall / 60:.1f} min ({run.wall / max(len(ms), 1):.1f} s a mutant) |", "",
        "| kind of mutant | made | killed | timeout | survived |", "|---|---|---|---|---|",
        *(f"| {k} | {sum(m.kind == k for m in ms)} | " + " | ".join(
            str(sum(m.kind == k and m.outcome == o for m in ms)) for o in ("killed", "timeout", "survived")) + " |"
          for k in sorted({m.kind for m in ms})), "",
        "| first failing test | mutants it killed |", "|---|---|",
        *(f"| `{t}` | {n} |" for t, n in Counter(m.by for m in ms if m.outcome == "killed").most_common()), "",
        "## Survivors", "",
        "Every mutant that survived this run, and those that survived an earlier one and carry a verdict: the",
        "verdict is written by hand and kept by re-runs (\"equivalent: <why>\", or \"killed by <test> after <fix>\").",
        "", "| # | line | kind | original | mutated | now | verdict |", "|---|---|---|---|---|---|---|",
        *(f"| {m.number} | {m.line} | {m.kind} | {cell(m.original)} | {cell(m.mutated)} | "
          f"{m.outcome}{' by ' + cell(m.by) if m.by else ''} | {verdict[m.number]} |" for m in rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines + ([] if rows else ["| | | | | | none | |"])) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("module", help="a module of the package, relative to the checkout: zerompi/optim/kinds.py")
    p.add_argument("--tests", nargs="+", help="the covering tests (default: COVERING, or the naming rule)")
    p.add_argument("--jobs", type=int, default=1, help="mutants tested at once, each in its own copy")
    p.add_argument("--timeout", type=float, help="seconds per mutant's tests (default 5 x unmutated + 30)")
    p.add_argument("--working-tree", action="store_true", help="test the working tree, not HEAD")
    p.add_argument("--mutants", help="only these numbers (comma-separated): printed, no report written")
    p.add_argument("--out", type=Path, help="the report (default results/mutation-<module>.md)")
    args = p.parse_args()
    module = (Path.cwd() / args.module).resolve().relative_to(ROOT).as_posix()
    commit = git("rev-parse", "--short", "HEAD")
    run = Run(module, args.tests or covering(module), " ".join(["benchmarks/mutation.py", *sys.argv[1:]]),
              f"the working tree at {commit} (with its uncommitted changes)" if args.working_tree
              else f"commit {commit}", os.getloadavg()[0])
    started = time.monotonic()
    trees = [make_copy(args.working_tree) for _ in range(max(args.jobs, 1))]
    try:
        imported = subprocess.run([sys.executable, "-c", "import zerompi; print(zerompi.__file__)"], check=False,
                                  cwd=trees[0], env=test_env(trees[0], False), capture_output=True, text=True)
        if not imported.stdout.startswith(str(trees[0])):
            sys.exit(f"zerompi imports from {imported.stdout.strip()!r}, not from the copy {trees[0]}")
        source = (trees[0] / module).read_bytes()
        ms, run.broken = mutants(source, module)
        run.size = len(source.splitlines())
        if args.mutants:
            ms = [m for m in ms if str(m.number) in args.mutants.split(",")]
        print(f"{module} at {run.tree}: {len(ms)} mutants ({run.broken} did not compile); tests: "
              f"{' '.join(run.tests)}", flush=True)
        outcome, by, run.baseline = run_tests(trees[0], run.tests, None, mutated=False)
        if outcome != "survived":
            sys.exit(f"the tests fail unmutated ({by}): fix them first")
        run.timeout = args.timeout or 5 * run.baseline + 30
        print(f"unmutated: passed in {run.baseline:.1f} s; timeout {run.timeout:.0f} s a mutant", flush=True)
        free: queue.Queue[Path] = queue.Queue()
        for tree in trees:
            free.put(tree)

        def one(m: Mutant) -> None:
            tree = free.get()
            try:
                apply(tree, module, m.source)
                m.outcome, m.by, took = run_tests(tree, run.tests, run.timeout)
            finally:
                apply(tree, module, source)
                free.put(tree)
            print(f"[{m.number}/{len(ms)}] line {m.line} {m.kind}: {m.original} -> {m.mutated}: {m.outcome}"
                  f"{' by ' + m.by if m.by else ''} ({took:.1f} s)", flush=True)

        with ThreadPoolExecutor(len(trees)) as pool:
            list(pool.map(one, ms))
    finally:
        for tree in trees:
            shutil.rmtree(tree, ignore_errors=True)
    run.wall = time.monotonic() - started
    print(f"{Counter(m.outcome for m in ms)} in {run.wall / 60:.1f} min", flush=True)
    if not args.mutants:
        report(args.out or report_path(module), run, ms)
        print(f"report: {args.out or report_path(module)}")


if __name__ == "__main__":
    main()
