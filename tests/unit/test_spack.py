"""spack.yaml and the py-zerompi recipe, checked structurally (Spack itself is not installable here).

The YAML must parse with ``spack`` as its only top-level key and only keys of
Spack's environment schema below it; every spec must be a well-formed spec
string (a small tokenizer of Spack's spec syntax, tested here too) naming a
package we expect; the package repository and recipe must exist and compile;
and the recipe's dependencies must say what pyproject.toml says.
"""
from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SPACK_YAML = ROOT / "spack.yaml"

# Keys Spack's environment schema (spack/schema/env.py and the config sections it merges) allows.
ENV_KEYS = {"specs", "view", "concretizer", "packages", "repos", "develop", "config", "compilers", "mirrors",
            "modules", "definitions", "include", "include_concrete", "upstreams", "container", "bootstrap",
            "ci", "cdash", "env_vars", "toolchains", "unify"}
MPI_PROVIDERS = {"mpich", "openmpi", "mvapich2", "mvapich", "intel-oneapi-mpi", "cray-mpich", "hpcx-mpi"}
REQUIRED = {"py-mpi4py", "py-torch", "hdf5", "py-h5py", "py-numpy", "py-pytest", "py-zerompi"}
OPTIONAL = {"py-hypothesis", "py-pyyaml"}

# ---- a tokenizer and parser for Spack spec strings --------------------------------------------
# name[@versions] [+variant ~variant key=value key==value] [%compiler[@versions]] [^dependency ...]

_NAME = r"[a-z0-9][a-z0-9_-]*"
_VERSION = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_RANGE = rf"(?:{_VERSION})?:(?:{_VERSION})?|{_VERSION}"
_TOKENS = re.compile(rf"""
    (?P<ws>\s+)
  | (?P<dep>\^)
  | (?P<version>@(?:=(?:{_VERSION})|(?:{_RANGE})(?:,(?:{_RANGE}))*))
  | (?P<bool>(?:\+\+|\+|~~|~){_NAME})
  | (?P<keyval>{_NAME}==?(?:"[^"]*"|'[^']*'|[A-Za-z0-9_.,:*/+-]+))
  | (?P<compiler>%)
  | (?P<name>(?:{_NAME}\.)*{_NAME})
""", re.VERBOSE)


class SpecError(ValueError):
    pass


@dataclass
class Node:
    name: str
    versions: str | None = None
    variants: dict[str, str | bool] = field(default_factory=dict)
    compiler: str | None = None
    deps: list["Node"] = field(default_factory=list)


def tokenize(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKENS.match(text, pos)
        if m is None or m.end() == pos:
            raise SpecError(f"{text!r}: cannot read {text[pos:]!r} (at {pos})")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _version_key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.-]", v))


def _check_versions(text: str, token: str) -> None:
    for part in token.lstrip("@=").split(","):
        lo, _, hi = part.partition(":")
        numeric = all(re.fullmatch(r"[0-9.]+", v) for v in (lo, hi) if v)
        if lo and hi and numeric and _version_key(lo) > _version_key(hi):
            raise SpecError(f"{text!r}: empty version range {part!r}")


def parse_spec(text: str) -> Node:
    """One spec: a named root, its versions/variants/compiler, then ^dependencies."""
    tokens = tokenize(text)
    if not tokens or tokens[0][0] != "name":
        raise SpecError(f"{text!r}: a spec starts with a package name")
    root = node = Node(tokens[0][1])
    i = 1
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "dep":
            if i + 1 >= len(tokens) or tokens[i + 1][0] != "name":
                raise SpecError(f"{text!r}: '^' must be followed by a package name")
            node = Node(tokens[i + 1][1])
            root.deps.append(node)
            i += 2
            continue
        if kind == "version":
            if node.versions is not None:
                raise SpecError(f"{text!r}: two version constraints on {node.name}")
            _check_versions(text, value)
            node.versions = value[1:]
        elif kind in ("bool", "keyval"):
            key = value.lstrip("+~").split("=", 1)[0]
            if key in node.variants:
                raise SpecError(f"{text!r}: variant {key!r} given twice on {node.name}")
            node.variants[key] = value.split("=", 1)[1].lstrip("=") if kind == "keyval" else value[0] == "+"
        elif kind == "compiler":
            if i + 1 >= len(tokens) or tokens[i + 1][0] != "name":
                raise SpecError(f"{text!r}: '%' must be followed by a compiler name")
            node.compiler = tokens[i + 1][1]
            i += 1
            if i + 1 < len(tokens) and tokens[i + 1][0] == "version":
                i += 1
        else:  # a second bare name: two specs in one string
            raise SpecError(f"{text!r}: unexpected {value!r}; one spec per list entry")
        i += 1
    return root


@pytest.mark.parametrize("text, name, versions, variants", [
    ("mpich", "mpich", None, {}),
    ("py-zerompi@=0.1.0", "py-zerompi", "=0.1.0", {}),
    ("py-mpi4py@4.0:", "py-mpi4py", "4.0:", {}),
    ("py-torch@2.4:2.13 +cuda cuda_arch=90", "py-torch", "2.4:2.13", {"cuda": True, "cuda_arch": "90"}),
    ("hdf5 +mpi ~fortran", "hdf5", None, {"mpi": True, "fortran": False}),
    ("hdf5+mpi~fortran", "hdf5", None, {"mpi": True, "fortran": False}),
    ("py-h5py@3.8: +mpi ^hdf5@1.14", "py-h5py", "3.8:", {"mpi": True}),
    ("openmpi fabrics=ucx,ofi schedulers=slurm", "openmpi", None, {"fabrics": "ucx,ofi", "schedulers": "slurm"}),
    ("builtin.mpich@:4.2,4.3.1", "builtin.mpich", ":4.2,4.3.1", {}),
    ("py-numpy@1.24: %gcc@12", "py-numpy", "1.24:", {}),
    ("cuda ++allow-unsupported-compilers target==x86_64_v3", "cuda", None,
     {"allow-unsupported-compilers": True, "target": "x86_64_v3"}),
])
def test_spec_parser_accepts(text, name, versions, variants):
    node = parse_spec(text)
    assert (node.name, node.versions, node.variants) == (name, versions, variants)


def test_spec_parser_dependencies():
    node = parse_spec("py-h5py +mpi ^hdf5@1.14 +mpi ^mpich@4")
    assert [(d.name, d.versions, d.variants) for d in node.deps] == [("hdf5", "1.14", {"mpi": True}),
                                                                     ("mpich", "4", {})]


@pytest.mark.parametrize("text", [
    "", "+mpi", "@1.0", "Py-Torch", "py-torch@", "py-torch@@2", "py-torch@2.4 @2.5", "hdf5 +mpi +mpi",
    "hdf5 + mpi", "mpich openmpi", "py-h5py ^", "py-h5py ^+mpi", "py-torch@3:2", "py-torch!", "a=b",
    "py-torch@2.4:-", "hdf5 %", "py-numpy@1.24: {}",
])
def test_spec_parser_rejects(text):
    with pytest.raises(SpecError):
        parse_spec(text)


# ---- spack.yaml ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env() -> dict:
    doc = yaml.safe_load(SPACK_YAML.read_text())
    assert isinstance(doc, dict) and list(doc) == ["spack"], "spack.yaml's one top-level key must be 'spack'"
    return doc["spack"]


@pytest.fixture(scope="module")
def specs(env) -> list[Node]:
    return [parse_spec(s) for s in env["specs"] if isinstance(s, str)]  # others: test_specs_are_strings


def test_keys_are_from_the_env_schema(env):
    assert set(env) <= ENV_KEYS, set(env) - ENV_KEYS
    assert {"specs", "view", "concretizer", "repos", "develop"} <= set(env)


def test_specs_are_strings(env):
    # YAML reads an unquoted "py-torch@2.4:" as a mapping; Spack wants strings.
    bad = [s for s in env["specs"] if not isinstance(s, str)]
    assert not bad, f"quote these specs: {bad}"


def test_specs_name_expected_packages(specs):
    names = [n.name for n in specs]
    assert len(names) == len(set(names)), names
    providers = set(names) & MPI_PROVIDERS
    assert len(providers) == 1, f"exactly one MPI provider, got {providers}"
    assert REQUIRED <= set(names), REQUIRED - set(names)
    assert set(names) <= REQUIRED | OPTIONAL | MPI_PROVIDERS, set(names) - REQUIRED - OPTIONAL - MPI_PROVIDERS


def test_mpi_provider_is_consistent(env, specs):
    (provider,) = {n.name for n in specs} & MPI_PROVIDERS
    preferred = env.get("packages", {}).get("all", {}).get("providers", {}).get("mpi")
    if preferred is not None:
        assert preferred[0] == provider, preferred
    # The other common provider is shown as a commented alternative.
    other = "openmpi" if provider != "openmpi" else "mpich"
    assert re.search(rf"^\s*#.*\b{other}\b", SPACK_YAML.read_text(), re.MULTILINE), f"no commented {other}"


def test_parallel_hdf5(specs):
    by_name = {n.name: n for n in specs}
    assert by_name["hdf5"].variants.get("mpi") is True
    assert by_name["py-h5py"].variants.get("mpi") is True


def test_concretizer_and_view(env):
    assert env["concretizer"] == {"unify": True}
    assert env["view"] is True


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_develop_builds_this_checkout(env, specs):
    (name,) = env["develop"]
    entry = env["develop"][name]
    assert set(entry) == {"spec", "path"}, entry
    node = parse_spec(entry["spec"])
    assert node.name == name == "py-zerompi"
    version = _pyproject()["project"]["version"]
    assert node.versions == f"={version}"
    assert [s for s in specs if s.name == name][0].versions == f"={version}"
    assert ((SPACK_YAML.parent / entry["path"]).resolve() / "pyproject.toml").is_file()


# ---- the package repository and recipe -------------------------------------------------------------

def _repo_dirs(env) -> list[Path]:
    repos = env["repos"]
    paths = list(repos.values()) if isinstance(repos, dict) else repos
    assert all(isinstance(p, str) for p in paths), repos
    return [(SPACK_YAML.parent / p).resolve() for p in paths]


def test_repo_layout(env):
    (repo,) = _repo_dirs(env)
    meta = yaml.safe_load((repo / "repo.yaml").read_text())
    assert re.fullmatch(r"[a-z_][a-z0-9_]*", meta["repo"]["namespace"]), meta
    packages = repo / meta["repo"].get("subdirectory", "packages")
    recipes = sorted(p.parent.name for p in packages.glob("*/package.py"))
    assert recipes == ["py-zerompi"], recipes


@pytest.fixture(scope="module")
def recipe(env) -> ast.ClassDef:
    (repo,) = _repo_dirs(env)
    path = repo / "packages" / "py-zerompi" / "package.py"
    source = path.read_text()
    compile(source, str(path), "exec")
    classes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    assert [c.name for c in classes] == ["PyZerompi"]  # Spack's class name for py-zerompi
    assert [b.id for b in classes[0].bases if isinstance(b, ast.Name)] == ["PythonPackage"]
    return classes[0]


def _calls(cls: ast.ClassDef, name: str) -> list[ast.Call]:
    return [n.value for n in cls.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Name) and n.value.func.id == name]


def _deps(cls: ast.ClassDef) -> dict[str, tuple[Node, frozenset[str]]]:
    out = {}
    for call in _calls(cls, "depends_on"):
        node = parse_spec(ast.literal_eval(call.args[0]))
        kind = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}.get("type", ("build", "link"))
        out[node.name] = (node, frozenset([kind] if isinstance(kind, str) else kind))
    return out


def _lower_bound(versions: str | None) -> tuple:
    assert versions is not None and versions.endswith(":") and ":" not in versions[:-1], versions
    return _trim(versions[:-1])


def _trim(version: str) -> tuple:
    parts = [int(p) for p in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _requirements(reqs: list[str]) -> dict[str, tuple | None]:
    """pyproject requirement strings -> {spack name: lower bound or None}; only 'name' and 'name>=X'."""
    out = {}
    for req in reqs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(?:>=\s*([0-9.]+))?\s*", req)
        assert m, f"{req!r}: teach test_spack.py this requirement form"
        out["py-" + m.group(1).lower().replace("_", "-")] = _trim(m.group(2)) if m.group(2) else None
    return out


def test_recipe_version_matches_pyproject(recipe):
    versions = [ast.literal_eval(c.args[0]) for c in _calls(recipe, "version")]
    assert versions == [_pyproject()["project"]["version"]]


def test_recipe_dependencies_match_pyproject(recipe):
    deps, doc = _deps(recipe), _pyproject()
    project = doc["project"]
    python, kinds = deps.pop("python")
    assert _lower_bound(python.versions) == _trim(project["requires-python"].removeprefix(">="))
    assert kinds == {"build", "run"}

    (setuptools_req,) = doc["build-system"]["requires"]
    assert _requirements([setuptools_req]) == {"py-setuptools": _lower_bound(deps["py-setuptools"][0].versions)}
    assert deps.pop("py-setuptools")[1] == {"build"}

    run = {name: (_lower_bound(n.versions), kinds) for name, (n, kinds) in deps.items() if "run" in kinds}
    assert {k: v for k, (v, _) in run.items()} == _requirements(project["dependencies"])
    assert all(kinds == {"build", "run"} for _, kinds in run.values())

    tests = {name: n.versions for name, (n, kinds) in deps.items() if kinds == {"test"}}
    for name, bound in _requirements(project["optional-dependencies"]["test"]).items():
        assert name in tests, f"{name} of the test extra is missing from the recipe"
        assert bound is None or _lower_bound(tests[name]) == bound, (name, tests[name], bound)
    assert set(deps) == set(run) | set(tests), set(deps) - set(run) - set(tests)


def test_recipe_and_environment_agree(recipe, specs):
    # Every bound the environment puts on a dependency of zerompi is at least the recipe's.
    deps = _deps(recipe)
    for node in specs:
        if node.name in deps and node.versions:
            assert _lower_bound(node.versions) >= _lower_bound(deps[node.name][0].versions), node
