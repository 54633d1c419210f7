"""DeepSpeed configs that shell scripts write: heredocs (``cat > x.json << EOF``) and templates filled
by ``sed "s/NAME/${VALUE}/"`` pipelines, with the script's own default values.

The script is read, never run: a line-by-line reading knows assignments, ``${N:-default}``
positional defaults, ``$((...))`` arithmetic and ``if [ "$A" = b ]`` tests. A test that reads a
positional argument without a default cannot be decided, so every branch of it is read (each
heredoc of a ``MODE=$1`` switch is a config of its own). A value the script cannot give (a
positional argument without default, a command substitution) leaves the config unfilled; it is
reported, not guessed.
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath

_VAR = re.compile(r"\\\$|\$\(\((.*?)\)\)|\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)|\$\(|`")
_ASSIGN = re.compile(r"^(?:export\s+|local\s+)?([A-Za-z_]\w*)=(.*)$")
_HEREDOC = re.compile(r"^cat\b.*<<-?\s*(['\"]?)(\w+)\1")
_TEST = re.compile(r"\[\[?\s*(\S+)\s+(=|==|!=|-eq|-ne|-gt|-lt|-ge|-le)\s+(\S+)\s*\]\]?")


class Unknown(Exception):
    """A value the script does not give (named in the message)."""


@dataclass
class Found:
    """One config text a script writes: ``how`` says heredoc or which template; ``missing`` what it lacked."""

    line: int
    how: str
    text: str | None
    missing: str = ""


@dataclass
class _Frame:
    active: bool
    decided: bool
    taken: bool = False


@dataclass
class Reader:
    """The script's variables as a top-to-bottom reading leaves them."""

    vars: dict[str, str] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)

    def expand(self, text: str, quoted_literal: bool = False) -> str:
        """``text`` with ``$X``, ``${X:-d}`` and ``$((...))`` replaced; Unknown where a value is missing."""
        def one(m: re.Match) -> str:
            if m.group(0) == "\\$":
                return "$"
            if m.group(1) is not None:
                return str(_arith(self.expand(m.group(1), True), self))
            name = m.group(2) or m.group(4)
            if name is None:
                raise Unknown("a command substitution")
            if name in self.vars:
                return self.vars[name]
            if name in self.unknown:
                raise Unknown(f"${{{name}}}, from {self.unknown[name]}")
            if m.group(3) is not None:
                return _unquote(self.expand(m.group(3)))
            if quoted_literal and not name.isdigit():
                return name  # $((a * b)): a bare name inside arithmetic is a variable read below
            if not name.isdigit():
                return ""  # never assigned: empty, as in the shell
            raise Unknown(f"${name}")
        return _VAR.sub(one, text)


def _arith(expr: str, reader: Reader) -> int:
    expr = re.sub(r"[A-Za-z_]\w*", lambda m: reader.vars.get(m.group(0), "0"), expr)
    if not re.fullmatch(r"[\d\s+\-*/%()]*", expr):
        raise Unknown(f"$(({expr}))")
    try:  # digits and operators only
        return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))
    except (ArithmeticError, SyntaxError):
        raise Unknown(f"$(({expr}))") from None


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def _value(raw: str) -> str:
    """An assignment's right side as one shell word, its comment dropped."""
    try:
        words = shlex.split(raw, comments=True)
    except ValueError:
        words = raw.split()
    return words[0] if words else ""


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out, buf, start = [], "", 0
    for no, line in enumerate(text.splitlines(), 1):
        if not buf:
            start = no
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def _test(cond: str, reader: Reader) -> bool | None:
    """A ``[ a op b ]`` test (joined by && or ||) decided, or None where it cannot be."""
    results, ops = [], re.findall(r"&&|\|\|", cond)
    tests = _TEST.findall(cond)
    if not tests or len(tests) != len(ops) + 1:
        return None
    for a, op, b in tests:
        try:
            a, b = _unquote(reader.expand(a)), _unquote(reader.expand(b))
        except Unknown:
            return None
        if op in ("=", "=="):
            results.append(a == b)
        elif op == "!=":
            results.append(a != b)
        elif not (a.lstrip("-").isdigit() and b.lstrip("-").isdigit()):
            return None
        else:
            x, y = int(a), int(b)
            results.append({"-eq": x == y, "-ne": x != y, "-gt": x > y, "-lt": x < y,
                            "-ge": x >= y, "-le": x <= y}[op])
    value = results[0]
    for op, r in zip(ops, results[1:]):
        value = (value and r) if op == "&&" else (value or r)
    return value


def _branch(stack: list[_Frame], word: str, rest: str, reader: Reader) -> None:
    """Track if/elif/else/fi; an undecidable test makes every branch of its if active."""
    if word == "if":
        outer = all(f.active for f in stack)
        verdict = _test(rest, reader) if outer else False
        stack.append(_Frame(active=verdict is not False, decided=verdict is not None,
                            taken=verdict is True))
    elif word == "elif" and stack:
        f = stack[-1]
        verdict = _test(rest, reader) if f.decided and not f.taken else None
        f.active = (not f.decided) or (not f.taken and verdict is not False)
        f.decided = f.decided and verdict is not None
        f.taken = f.taken or verdict is True
    elif word == "else" and stack:
        f = stack[-1]
        f.active = not f.decided or not f.taken
    elif word == "fi" and stack:
        stack.pop()


_CALL = re.compile(r"^(?:bash|sh)\s+(\S+\.sh)\b(.*?)&?$")


def read_script(text: str, path: str, read: Callable[[str], str | None], reader: Reader | None = None,
                depth: int = 0) -> list[Found]:
    """Every JSON config the script writes by heredoc or by a sed-filled template, and those of the
    scripts it runs with ``bash other.sh args`` (read with those arguments)."""
    reader, stack, found = reader or Reader(), [], []
    lines = _logical_lines(text)
    i = 0
    while i < len(lines):
        no, line = lines[i]
        i += 1
        s = line.strip()
        word = re.split(r"[\s;]", s, 1)[0] if s else ""
        if word in ("if", "elif", "else", "fi"):
            _branch(stack, word, s, reader)
            continue
        if not all(f.active for f in stack) or s.startswith("#"):
            continue
        heredoc = _HEREDOC.match(s)
        if heredoc:
            body = []
            while i < len(lines) and lines[i][1].strip() != heredoc.group(2):
                body.append(lines[i][1])
                i += 1
            i += 1
            found.append(_heredoc(no, "\n".join(body), heredoc.group(1) != "", reader))
        elif s.startswith("sed ") and ">" in s:
            found.append(_sed(no, s, path, reader, read))
        elif _CALL.match(s) and depth == 0:
            found += _call(no, _CALL.match(s), path, reader, read)
        elif _ASSIGN.match(s):
            name, raw = _ASSIGN.match(s).groups()
            try:
                reader.vars[name] = reader.expand(_value(raw)) if not raw.lstrip().startswith("'") else _value(raw)
                reader.unknown.pop(name, None)
            except Unknown as e:
                reader.vars.pop(name, None)
                reader.unknown[name] = str(e)
    return [f for f in found if f.text is None or f.text.lstrip().startswith("{")]


def _call(no: int, m: re.Match, path: str, reader: Reader, read: Callable[[str], str | None]) -> list[Found]:
    """The configs a called script writes, its positional arguments those of the call."""
    callee, text = _locate(path, m.group(1), read)
    if text is None:
        return []
    inner = Reader()
    for i, word in enumerate(shlex.split(m.group(2), comments=True), 1):
        try:
            inner.vars[str(i)] = _unquote(reader.expand(word))
        except Unknown as e:
            inner.unknown[str(i)] = str(e)
    return [Found(no, f"{f.how}, {callee}:{f.line} as line {no} runs it", f.text, f.missing)
            for f in read_script(text, callee, read, inner, depth=1)]


def _heredoc(no: int, body: str, quoted: bool, reader: Reader) -> Found:
    if quoted:
        return Found(no, "heredoc", body)
    try:
        return Found(no, "heredoc", reader.expand(body))
    except Unknown as e:
        return Found(no, "heredoc", None, str(e))


def _sed(no: int, line: str, path: str, reader: Reader, read: Callable[[str], str | None]) -> Found:
    """A ``sed ... template | sed ... > out`` pipeline applied to the template, as the script runs it."""
    pipeline = line.rsplit(">", 1)[0]
    exprs, template = [], None
    try:
        for part in pipeline.split("|"):
            # split first, expand each word: a value's own quotes stay, as in the shell
            words = [reader.expand(w) for w in shlex.split(part)]
            for w in words[1:]:
                if re.match(r"s(.).*\1.*\1\w*$", w):
                    exprs.append(w)
                elif not w.startswith("-"):
                    template = w
    except Unknown as e:
        return Found(no, "sed template", None, str(e))
    if template is None:
        return Found(no, "sed template", None, "no template file")
    where, text = _locate(path, template, read)
    if text is None:
        return Found(no, f"sed template {template}", None, "template not found")
    lines = text.splitlines()
    for e in exprs:
        d = e[1]
        pat, rep, flags = e[2:].split(d)[:3]
        lines = [ln.replace(pat, rep) if "g" in flags else ln.replace(pat, rep, 1) for ln in lines]
    return Found(no, f"sed-filled template {where}", "\n".join(lines))


def _locate(script: str, name: str, read: Callable[[str], str | None]) -> tuple[str, str | None]:
    """The template beside the script or in a folder above it (scripts run from their project's root)."""
    folder = PurePosixPath(script).parent
    for base in [folder, *folder.parents]:
        candidate = str(PurePosixPath(base, name))
        parts = []
        for p in candidate.split("/"):
            if p == "..":
                parts = parts[:-1]
            elif p not in (".", ""):
                parts.append(p)
        text = read("/".join(parts))
        if text is not None:
            return "/".join(parts), text
    return name, None
