"""The mutants of scripts/mutation.py: which AST nodes are changed, how, and the mutated module's code.

A mutation point is a (node, change) pair found by walking a file's AST in a fixed order; mutant `index` of a
file is its index-th point, so the same file always gives the same mutants (docs/mutation.md lists the kinds).
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]


# -- the mutations -----------------------------------------------------------------------------------------------
BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
          ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}
CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
          ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
NAME_SWAPS = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum", "amin": "amax",
              "amax": "amin", "any": "all", "all": "any", "argmax": "argmin", "argmin": "argmax",
              "clamp_min": "clamp_max", "clamp_max": "clamp_min", "floor": "ceil", "ceil": "floor"}
SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
          ast.BitAnd: "&", ast.BitOr: "|", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
          ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.And: "and",
          ast.Or: "or"}
QUIET_CALLS = {"warning", "info", "debug", "warn", "error", "exception"}  # log/warnings calls: text only


@dataclass
class Mutant:
    file: str  # repository-relative path
    index: int  # the index-th mutation point of the file, in `_points` order
    line: int
    column: int  # of the mutated node: tells apart two equal mutations on one line
    function: str  # enclosing qualname ("" at module level)
    description: str  # e.g. "< -> <="
    source: str  # the original line, stripped
    status: str = "pending"  # killed | survived | timeout | no_tests | error | equivalent
    tests: list[str] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0
    repeat: int = 0  # earlier mutants of the file with the same key: an identical line twice in one function

    @property
    def key(self) -> tuple:
        """What names the mutant across edits that move lines (no line number); `repeat` only where needed, so the
        keys of equivalents.toml stay five fields."""
        key = (self.file, self.function, self.source, self.description, self.column)
        return key + (self.repeat,) if self.repeat else key


def _mutations(node: ast.AST) -> list[tuple[str, callable]]:
    """The mutations of one node: (description, apply(node) -> replacement node)."""
    out = []
    if isinstance(node, ast.BinOp) and type(node.op) in BINOPS:
        new = BINOPS[type(node.op)]
        out.append((f"{SYMBOL[type(node.op)]} -> {SYMBOL[new]}", lambda n, new=new: _with(n, op=new())))
    elif isinstance(node, ast.AugAssign) and type(node.op) in BINOPS:
        new = BINOPS[type(node.op)]
        out.append((f"{SYMBOL[type(node.op)]}= -> {SYMBOL[new]}=", lambda n, new=new: _with(n, op=new())))
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in CMPOPS:
                new = CMPOPS[type(op)]

                def swap(n, i=i, new=new):
                    ops = list(n.ops)
                    ops[i] = new()
                    return _with(n, ops=ops)
                out.append((f"{SYMBOL[type(op)]} -> {SYMBOL[new]}", swap))
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append((f"{SYMBOL[type(node.op)]} -> {SYMBOL[new]}", lambda n, new=new: _with(n, op=new())))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append(("not x -> x" if isinstance(node.op, ast.Not) else "-x -> x", lambda n: n.operand))
    elif isinstance(node, ast.Constant) and type(node.value) in (bool, int, float):
        value = node.value
        if isinstance(value, bool):
            new_value = not value
        elif isinstance(value, int):
            new_value = value + 1
        else:
            new_value = value * 2 if value not in (0.0,) else 1.0
        out.append((f"{value!r} -> {new_value!r}", lambda n, v=new_value: ast.Constant(v)))
    elif isinstance(node, ast.Attribute) and node.attr in NAME_SWAPS:
        new = NAME_SWAPS[node.attr]
        out.append((f".{node.attr} -> .{new}", lambda n, new=new: _with(n, attr=new)))
    elif isinstance(node, ast.Name) and node.id in NAME_SWAPS and node.id in ("min", "max", "any", "all"):
        new = NAME_SWAPS[node.id]
        out.append((f"{node.id} -> {new}", lambda n, new=new: _with(n, id=new)))
    elif isinstance(node, (ast.If, ast.While)):
        out.append(("if c -> if not c", lambda n: _with(n, test=ast.UnaryOp(ast.Not(), n.test))))
    elif isinstance(node, ast.Break):
        out.append(("break -> continue", lambda n: ast.Continue()))
    elif isinstance(node, ast.Continue):
        out.append(("continue -> break", lambda n: ast.Break()))
    return out


def _with(node: ast.AST, **changes) -> ast.AST:
    new = copy.copy(node)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def _skipped(node: ast.AST) -> bool:
    """Subtrees whose mutants would only change texts, types or imports."""
    if isinstance(node, (ast.JoinedStr, ast.Import, ast.ImportFrom, ast.Raise, ast.Assert)):
        return True
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # docstrings
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in QUIET_CALLS
    return False


def _children(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Child fields to walk, without annotations (types) and the message of a raise."""
    for name, value in ast.iter_fields(node):
        if name in ("annotation", "returns", "type_comment", "decorator_list"):
            continue
        if isinstance(value, list):
            for item in value:
                if isinstance(item, ast.AST):
                    yield name, item
        elif isinstance(value, ast.AST):
            yield name, value


def _walk(node: ast.AST, scope: str, no_mutate: set[int]) -> Iterator[tuple[ast.AST, str]]:
    """Mutable nodes in a fixed order, with their enclosing qualname."""
    if _skipped(node):
        return
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        scope = f"{scope}.{node.name}" if scope else node.name
    if getattr(node, "lineno", None) not in no_mutate:
        yield node, scope
    for _, child in _children(node):
        yield from _walk(child, scope, no_mutate)


def _points(tree: ast.Module, lines: list[str]) -> list[tuple[ast.AST, str, str, callable]]:
    no_mutate = {i + 1 for i, text in enumerate(lines) if "pragma: no mutate" in text}
    out = []
    for node, scope in _walk(tree, "", no_mutate):
        for description, apply in _mutations(node):
            out.append((node, scope, description, apply))
    return out


def list_mutants(path: Path) -> list[Mutant]:
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    rel = str(path.relative_to(REPO))
    mutants: list[Mutant] = []
    seen: dict[tuple, int] = {}
    for i, (node, scope, description, _) in enumerate(_points(tree, lines)):
        mutant = Mutant(rel, i, node.lineno, node.col_offset, scope, description, lines[node.lineno - 1].strip())
        mutant.repeat = seen.get(mutant.key, 0)
        seen[mutant.key] = mutant.repeat + 1
        mutants.append(mutant)
    return mutants


def mutated_code(path: Path, index: int):
    """The module's code object with mutation `index` applied."""
    text = path.read_text()
    tree = ast.parse(text)
    target, _, _, apply = _points(tree, text.splitlines())[index]

    class Replace(ast.NodeTransformer):
        def visit(self, node):
            if node is target:
                return ast.copy_location(apply(node), node)
            return self.generic_visit(node)

    tree = ast.fix_missing_locations(Replace().visit(tree))
    return compile(tree, str(path), "exec", dont_inherit=True)
