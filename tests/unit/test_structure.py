"""The package's shape: module size, one mpi4py importer, and an import graph without cycles.

Imports are read from the source (module level and inside functions alike), so a cycle
that only a lazy import hides still fails here.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "zerompi"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (``from pkg import mod`` counts as importing mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def test_no_module_over_400_lines():
    long = {n: len(p.read_text().splitlines()) for n, p in _modules().items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}


def test_only_comm_mpi_library_imports_mpi4py():
    users = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(m == "mpi4py" or m.startswith("mpi4py.") for m in mods):
                users.add(name)
    assert users == {"zerompi.comm.mpi.library"}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None
    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_import_graph_has_no_cycle():
    mods = _modules()
    # A package's __init__ re-exporting its modules is not a dependency of those modules on it.
    graph = {n: {m for m in _imports(n, p, set(mods)) if not n.startswith(m + ".")} for n, p in mods.items()}
    assert _cycle(graph) is None


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _unit(name: str) -> str:
    """A module's folder under zerompi/, or the top-level module itself (``zerompi.engine`` -> ``engine``)."""
    return name.split(".")[1] if "." in name else name


def _folder_edges() -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(importing unit, imported unit) -> the module imports behind it; the package's __init__ left out
    (it re-exports the public names of the folders it sits above)."""
    mods = _modules()
    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for n, p in mods.items():
        for m in _imports(n, p, set(mods)):
            if "zerompi" not in (n, m) and _unit(n) != _unit(m):
                edges.setdefault((_unit(n), _unit(m)), []).append((n, m))
    return edges


def test_no_folder_imports_a_folder_that_imports_it_back():
    """Dependencies point down: a folder (or top-level module) that another imports imports nothing of it.
    A tie both ways, even through different modules, is a layer written upside down."""
    edges = _folder_edges()
    ties = {f"{a} <-> {b}": edges[(a, b)] + edges[(b, a)] for a, b in edges if a < b and (b, a) in edges}
    assert ties == {}


def test_the_layers_below_checkpoint_declare_their_state_without_importing_it():
    """optim/, shard/ and comm/ say what state they hold in state/'s vocabulary; checkpoint/ reads and
    writes what they declare."""
    edges = _folder_edges()
    up = {(a, b): edges[(a, b)] for a, b in edges if a in ("optim", "shard", "comm", "state") and b == "checkpoint"}
    assert up == {}


def test_a_bucket_is_storage_and_builds_no_collective():
    """shard/bucket.py holds buffers, tiers, master and gradient shard: it imports nothing that communicates
    (comm/, the strategies, their factory or the collectives that drive them) and names no collective verb.
    What crosses the network for a bucket is shard/collectives.py's, which the sharded model builds."""
    known = set(_modules())
    path = PKG / "shard" / "bucket.py"
    imported = _imports("zerompi.shard.bucket", path, known)
    communicating = {m for m in imported if m.startswith("zerompi.comm") or m in (
        "zerompi.shard.sync", "zerompi.shard.wiring", "zerompi.shard.collectives", "zerompi.shard.compression")}
    assert communicating == set()
    calls = {n.func.attr for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    verbs = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "build", "gather", "publish",
             "start", "finish", "wait", "test"}
    assert calls & verbs == set()
