"""Every user-facing error draftlab can print, found in src/draftlab by reading its syntax tree.

A user-facing error is one the CLI prints as `error: <message>` (draftlab.cli.command): a
`UserError` subclass constructed anywhere, a call to a helper whose body raises one with its
argument (`cli._fail`), a `ValueError` raised in a pydantic validator (it reaches the user
inside a `ParamsError` or `SpaceError` line), and the errors the training rank turns into the
run's failure line (`USER_FACING_ALSO`, `USER_FACING_RECORDS`). Each site's message becomes a template: the literal
text, module-level string constants resolved, `…` where a value is filled in. docs/errors.md
quotes every template; tests/unit/test_docs.py holds the two in step.

    python scripts/error_sites.py          # list every site and its template
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "draftlab"
ROOT_ERROR = "UserError"
# Not UserErrors, but their message is the line a user reads: the rank catches them and the
# launcher's TrainingFailed prints it (draftlab.training.rank).
USER_FACING_ALSO = {"HiddenStateFileError"}
# Records whose `message` the launcher prints in its TrainingFailed line (rundir.Failure).
USER_FACING_RECORDS = {"Failure": "message"}
HOLE = "…"


@dataclasses.dataclass(frozen=True)
class Site:
    path: str  # relative to the repository root
    line: int
    function: str
    error: str
    template: str | None  # None: the message is built elsewhere (see `source`)
    source: str  # the message expression as written

    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.function}, {self.error})"


def _modules() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(SRC.rglob("*.py"))}


def _error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """Names of every class deriving (in src) from UserError, itself included."""
    bases: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {_name(b) for b in node.bases}
    found = {ROOT_ERROR}
    while True:
        more = {c for c, bs in bases.items() if c not in found and bs & found}
        if not more:
            return found | USER_FACING_ALSO
        found |= more


def _constants(trees: dict[Path, ast.Module]) -> dict[str, str | None]:
    """Module-level `NAME = "text"` across src (None where two modules disagree)."""
    out: dict[str, str | None] = {}
    for tree in trees.values():
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, (ast.Constant, ast.JoinedStr))):
                text = _template(node.value, {})
                name = node.targets[0].id
                if text is not None:
                    out[name] = text if out.get(name, text) == text else None
    return out


# functions that return a UserError subclass to be called with the message (training.job)
ERROR_FACTORIES = {"failed_error"}

def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _template(node: ast.AST, constants: dict[str, str | None]) -> str | None:
    """The message with every filled-in value as `…`; None if no literal text is in it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                inner = _template(v.value, constants) if isinstance(v, ast.FormattedValue) else None
                parts.append(inner if inner is not None and not _is_literal_free(v.value) else HOLE)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left, constants), _template(node.right, constants)
        if left is None and right is None:
            return None
        return (left if left is not None else HOLE) + (right if right is not None else HOLE)
    if isinstance(node, (ast.Name, ast.Attribute)):
        value = constants.get(_name(node))
        return value
    return None


def _is_literal_free(node: ast.AST) -> bool:
    """A formatted value that is a variable, call or expression, not a string constant."""
    return not isinstance(node, (ast.Name, ast.Attribute, ast.Constant, ast.JoinedStr))


class _Visitor(ast.NodeVisitor):
    def __init__(self, path: str, errors: set[str], helpers: set[str], constants: dict[str, str | None]):
        self.path, self.errors, self.helpers, self.constants = path, errors, helpers, constants
        self.stack: list[str] = []
        self.functions: list[ast.AST] = []
        self.validator_depth = 0
        self.sites: list[Site] = []

    def _scope(self, node):
        is_validator = any(_name(d.func if isinstance(d, ast.Call) else d).endswith("_validator")
                           for d in getattr(node, "decorator_list", []))
        self.stack.append(node.name)
        self.functions.append(node)
        self.validator_depth += is_validator
        self.generic_visit(node)
        self.validator_depth -= is_validator
        self.functions.pop()
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Call(self, node: ast.Call):
        callee = _name(node.func)
        if isinstance(node.func, ast.Call) and _name(node.func.func) in ERROR_FACTORIES:
            callee = _name(node.func.func)  # `failed_error(failure)(message)`: the factory picks the class
        is_error = callee in self.errors or callee in self.helpers or isinstance(node.func, ast.Call) and callee in ERROR_FACTORIES
        if callee == "ValueError" and self.validator_depth:
            is_error = True
        arg = node.args[0] if is_error and node.args else None
        if callee in USER_FACING_RECORDS:
            arg = next((k.value for k in node.keywords if k.arg == USER_FACING_RECORDS[callee]), None)
        if arg is not None and not (callee in self.helpers and self.stack[-1:] == [callee]):
            template = _template(arg, self.constants)
            if template is None and isinstance(arg, ast.Name):
                template = self._assigned(arg.id, node.lineno)
            self.sites.append(Site(self.path, node.lineno, ".".join(self.stack) or "<module>", callee,
                                   template, ast.unparse(arg)))
        self.generic_visit(node)

    def _assigned(self, name: str, before: int) -> str | None:
        """The message a local variable holds: its last `name = <text>` above the call."""
        if not self.functions:
            return None
        found = None
        for n in ast.walk(self.functions[-1]):
            if (isinstance(n, ast.Assign) and n.lineno < before and len(n.targets) == 1
                    and isinstance(n.targets[0], ast.Name) and n.targets[0].id == name
                    and (found is None or n.lineno > found.lineno)):
                found = n
        return _template(found.value, self.constants) if found is not None else None


def _helpers(trees: dict[Path, ast.Module], errors: set[str]) -> set[str]:
    """Functions whose body raises a user error with their own first argument (`_fail(message)`)."""
    out = set()
    for tree in trees.values():
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.args.args and len(fn.body) == 1:
                stmt, param = fn.body[0], fn.args.args[0].arg
                if (isinstance(stmt, ast.Raise) and isinstance(stmt.exc, ast.Call)
                        and _name(stmt.exc.func) in errors and stmt.exc.args
                        and isinstance(stmt.exc.args[0], ast.Name) and stmt.exc.args[0].id == param):
                    out.add(fn.name)
    return out


def sites() -> list[Site]:
    """Every place in src/draftlab that makes a user-facing error, in file and line order."""
    trees = _modules()
    errors, constants = _error_classes(trees), _constants(trees)
    helpers = _helpers(trees, errors)
    out: list[Site] = []
    root = SRC.parent.parent
    for path, tree in trees.items():
        v = _Visitor(str(path.relative_to(root)), errors, helpers, constants)
        v.visit(tree)
        out.extend(s for s in v.sites if not _passes_on(s, helpers))
    return out


def _passes_on(site: Site, helpers: set[str]) -> bool:
    """`raise UserError(message)` inside the helper itself is not a site of its own."""
    return site.function.split(".")[-1] in helpers and site.template is None


if __name__ == "__main__":
    for s in sites():
        print(f"{s.where()}\n    {s.template if s.template is not None else '<built from ' + s.source + '>'}")
    print(f"{len(sites())} sites", file=sys.stderr)
