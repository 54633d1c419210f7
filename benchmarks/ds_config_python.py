"""DeepSpeed configs written in Python: dict literals a script passes as its config, and the
builder functions DeepSpeed-Chat calls.

A dict literal is a config when its own keys name a batch size or ``zero_optimization``. Where it
reads names, each takes the value the script gives it by default: an ``args.X`` its argparse
default (``store_true``: False), a parameter its default, a variable its last plain assignment
above; what is left must be constants and operators, evaluated without builtins. A literal that
still reads something else (a call, a parameter without default) is reported as not static.
"""
from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from typing import Any

MARKERS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization"})
# builtins a literal may call on its constants
_CALLS = {"bool": bool, "int": int, "float": float, "str": str, "min": min, "max": max, "abs": abs}
_TORCH_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32",
                 "float": "float32"}
_PURE = (ast.Expression, ast.Constant, ast.Dict, ast.List, ast.Tuple, ast.Set, ast.BinOp, ast.UnaryOp,
         ast.BoolOp, ast.Compare, ast.IfExp, ast.JoinedStr, ast.FormattedValue, ast.expr_context,
         ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


class NotStatic(Exception):
    """The literal reads something without a default value (named in the message)."""


@dataclass
class FoundPy:
    line: int
    how: str
    config: dict | None
    missing: str = ""


def argparse_defaults(tree: ast.AST) -> dict[str, ast.expr]:
    """Each ``add_argument("--x", ...)``'s dest and its default as an expression."""
    out: dict[str, ast.expr] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        kw = {k.arg: k.value for k in node.keywords}
        longs = [f for f in flags if f.startswith("--")] or flags
        if not longs:
            continue
        dest = kw["dest"].value if isinstance(kw.get("dest"), ast.Constant) else longs[0].lstrip("-").replace("-", "_")
        action = kw["action"].value if isinstance(kw.get("action"), ast.Constant) else None
        if "default" in kw:
            out[dest] = kw["default"]
        else:
            out[dest] = ast.Constant({"store_true": False, "store_false": True}.get(action))
    return out


Bindings = dict[str, list[tuple[int, ast.expr]]]


def _scope_names(tree: ast.Module, func: ast.FunctionDef | None) -> Bindings:
    """Each name's bindings by line: module assignments, the function's parameter defaults (at
    its ``def`` line) and its assignments."""
    names: Bindings = {}
    nodes = list(tree.body)
    if func:
        a = func.args
        positional = a.posonlyargs + a.args
        pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
        pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
        for arg, default in pairs:
            names.setdefault(arg.arg, []).append((func.lineno, default))
        nodes += list(ast.walk(func))
    for node in nodes:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            names.setdefault(node.targets[0].id, []).append((node.lineno, node.value))
    return {k: sorted(v, key=lambda b: b[0]) for k, v in names.items()}


class _Resolve(ast.NodeTransformer):
    """Replace names by their default expressions, recording what was used. A name takes its last
    binding above the line that reads it; one that reads a call falls back to the binding before it
    (``x = hparams.get("x", x)`` keeps the parameter's default), which the record says."""

    def __init__(self, names: Bindings, args: dict[str, ast.expr], line: int):
        self.names, self.args, self.used, self.lines = names, args, {}, [line]

    def _try(self, label: str, line: int, expr: ast.expr) -> ast.expr:
        self.lines.append(line)
        try:
            out = self.visit(_copy(expr))
            bad = next((n for n in ast.walk(out) if not _pure(n)), None)
            if bad is not None:
                raise NotStatic(f"reads {ast.unparse(bad)[:60]}")
            return out
        finally:
            self.lines.pop()

    def visit_Name(self, node: ast.Name) -> ast.expr:
        bindings = [b for b in self.names.get(node.id, []) if b[0] < self.lines[-1]]
        for i, (line, expr) in enumerate(reversed(bindings)):
            try:
                out = self._try(node.id, line, expr)
            except NotStatic:
                if i == len(bindings) - 1:
                    raise
                continue
            self.used[node.id] = ast.unparse(expr) + (f" (line {line}; later ones read calls)" if i else "")
            return out
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.expr:
        base = node.value
        if isinstance(base, ast.Name) and base.id == "torch" and node.attr in _TORCH_DTYPES:
            return ast.Constant(_TORCH_DTYPES[node.attr])  # compared, never passed on
        owner = (base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute)
                 else "args" if isinstance(base, ast.Call) and ast.unparse(base.func).endswith("parse_args") else "")
        if owner.endswith("args") and node.attr in self.args:
            self.used[f"args.{node.attr}"] = ast.unparse(self.args[node.attr])
            return self._try(f"args.{node.attr}", 0, self.args[node.attr])
        return self.generic_visit(node)


def _pure(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id in _CALLS and not node.keywords
    return isinstance(node, _PURE) or (isinstance(node, ast.Name) and node.id in _CALLS)


def _copy(node: ast.expr) -> ast.expr:
    return ast.parse(ast.unparse(node), mode="eval").body


def evaluate(node: ast.expr, names: Bindings, args: dict[str, ast.expr]) -> tuple[Any, dict]:
    """The literal's value with defaults put in, and the defaults used; NotStatic if it reads more."""
    resolver = _Resolve(names, args, node.lineno)
    body = resolver._try("", node.lineno + 1, node)
    expr = ast.fix_missing_locations(ast.Expression(body))
    try:  # constants, operators and _CALLS only
        value = eval(compile(expr, "<literal>", "eval"), {"__builtins__": {}, **_CALLS})
    except Exception as e:  # noqa: BLE001  (e.g. a default of the wrong type for an operator)
        raise NotStatic(f"{type(e).__name__}: {e}") from None
    return value, resolver.used


def _config_dicts(tree: ast.Module) -> list[tuple[ast.Dict, ast.FunctionDef | None]]:
    """The outermost dict literals whose own keys mark a DeepSpeed config, with their function."""
    found = []

    def walk(node: ast.AST, func: ast.FunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Dict) and {k.value for k in child.keys
                                                if isinstance(k, ast.Constant)} & MARKERS:
                found.append((child, func))
                continue
            walk(child, child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func)
    walk(tree, None)
    return found


def read_python(text: str) -> list[FoundPy]:
    """Every config dict literal of a Python file, evaluated with the file's defaults."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    args = argparse_defaults(tree)
    out = []
    for node, func in _config_dicts(tree):
        try:
            value, used = evaluate(node, _scope_names(tree, func), args)
        except NotStatic as e:
            out.append(FoundPy(node.lineno, "dict literal", None, str(e)))
            continue
        how = "dict literal" + (", defaults " + ", ".join(f"{k}={v}" for k, v in used.items()) if used else "")
        out.append(FoundPy(node.lineno, how, value if isinstance(value, dict) else None))
    return out


def default_namespace(text: str) -> argparse.Namespace:
    """A script's parsed arguments as it runs with none given (defaults that are not literals: None)."""
    values = {}
    for dest, expr in argparse_defaults(ast.parse(text)).items():
        try:
            values[dest] = ast.literal_eval(expr)
        except ValueError:
            values[dest] = None
    return argparse.Namespace(**values)


def call_builder(source: str, path: str, func: str, *args: Any, **kwargs: Any) -> dict:
    """Call a config builder defined in ``source`` (a module of plain dict-building functions)."""
    namespace: dict[str, Any] = {"__name__": "ds_config_builder"}
    exec(compile(source, path, "exec"), namespace)  # noqa: S102  (the builder is the config's source)
    return namespace[func](*args, **kwargs)
