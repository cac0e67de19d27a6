"""The package contracts the docstrings state, read from the code: every `import draftlab…` (those
inside functions too) against its package's "May import:" line, no two packages importing each
other, the shared core importing no package, and the names spelled in one module alone (run-folder
files in `rundir`, default paths in `paths`, MLflow clients in `tracking`, speculators' private
names in its two seams). A failure names the file and line that breaks the contract."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import yaml

import draftlab
from draftlab import paths, rundir

SRC = Path(draftlab.__file__).parent
REPO = SRC.parents[1]
PACKAGES = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
CORE_ALL = sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([\w.]+)`", text)


def entry_points() -> set[str]:
    line = next(x for x in (draftlab.__doc__ or "").splitlines() if x.startswith("Entry points:"))
    return set(_backticked(line))


def shared_core() -> set[str]:
    return set(CORE_ALL) - entry_points()


@cache
def may_import(package: str) -> tuple[bool, frozenset[str]]:
    """(the shared core allowed, the packages and package.modules named) of a package's docstring."""
    doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text())) or ""
    match = re.search(r"May import:(.*?)(?:\n\s*\n|$)", doc, re.S)
    assert match, f"src/draftlab/{package}/__init__.py: its docstring has no 'May import:' line"
    allowed = match.group(1).split("Never", 1)[0]
    return "the shared core" in allowed, frozenset(_backticked(allowed))


def _unit(path: Path) -> str:
    """A module's package, or `core:<name>` for a module at the top."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else f"core:{path.stem}"


def _target(dotted: str) -> str | None:
    """`draftlab.store.layout.X` → `store.layout`; `draftlab.paths` → `paths`; else None."""
    parts = dotted.split(".")
    if parts[0] != "draftlab" or len(parts) < 2:
        return None
    if parts[1] in PACKAGES:
        return f"{parts[1]}.{parts[2]}" if len(parts) > 2 and (SRC / parts[1] / f"{parts[2]}.py").is_file() else parts[1]
    return parts[1]


def draftlab_imports(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every draftlab import in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out += [(node.lineno, t) for t in map(_target, names) if t is not None]
    return out


def _modules():
    return sorted(p for p in SRC.rglob("*.py"))


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO)}:{line}"


def test_every_package_states_what_it_owns_and_may_import():
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) >= 3, f"src/draftlab/{package}/__init__.py: say what the package owns"
        core, named = may_import(package)
        for name in named:
            assert name.split(".")[0] in PACKAGES and name.split(".")[0] != package, \
                f"src/draftlab/{package}/__init__.py: `{name}` in 'May import:' is not another package or its module"


def test_every_import_keeps_its_packages_contract():
    broken = []
    for path in _modules():
        unit = _unit(path)
        if unit.startswith("core:"):
            continue
        core_ok, named = may_import(unit)
        for line, target in draftlab_imports(path):
            top = target.split(".")[0]
            if top == unit or (top in shared_core() and core_ok) or top in named or target in named:
                continue
            broken.append(f"{_where(path, line)}: imports draftlab.{target}, which src/draftlab/{unit}/__init__.py's "
                          "'May import:' does not name")
    assert not broken, "\n".join(broken)


def test_the_shared_core_imports_no_package_and_no_entry_point():
    broken = [f"{_where(path, line)}: the shared core module {path.stem} imports draftlab.{target}"
              for path in _modules() if _unit(path).removeprefix("core:") in shared_core()
              for line, target in draftlab_imports(path) if target.split(".")[0] not in shared_core()]
    assert not broken, "\n".join(broken)


def test_no_two_packages_import_each_other():
    first: dict[tuple[str, str], str] = {}
    for path in _modules():
        unit = _unit(path)
        for line, target in draftlab_imports(path):
            top = target.split(".")[0]
            if unit in PACKAGES and top in PACKAGES and top != unit:
                first.setdefault((unit, top), _where(path, line))
    both = [f"{a} ↔ {b}: {first[a, b]} and {first[b, a]}" for a, b in first if a < b and (b, a) in first]
    assert not both, "\n".join(both)


def _strings(path: Path):
    """(line, value) of every string constant that is not a docstring."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def _spelled(names: set[str], owner: Path, why: str) -> list[str]:
    return [f"{_where(path, line)}: {value!r} spells {why} named in {owner.relative_to(REPO)}; use it from there"
            for path in _modules() if path != owner for line, value in _strings(path)
            if any(value == n or value.endswith("/" + n) for n in names)]


def run_folder_names() -> set[str]:
    names = set()
    for folder in (rundir.RunDir, rundir.StoreDir, rundir.TrialDir, rundir.StudyDir):
        for attr, value in vars(folder).items():
            got = getattr(folder(Path("/r")), attr) if isinstance(value, property) else None
            if isinstance(got, (rundir.JsonFile, Path)):
                names.add((got.path if isinstance(got, rundir.JsonFile) else got).name)
    names |= {rundir.RunDir(Path("/r")).lock_path().name, rundir.RunDir(Path("/r")).launch_file().path.name}
    return {n for n in names if n.endswith((".json", ".jsonl")) or n.startswith(".")}


def test_run_folder_file_names_are_spelled_in_rundir_alone():
    names = run_folder_names()
    assert {"bottleneck-live.json", "failure.json", "run.json", "manifest.json", ".r.lock"} <= names
    broken = _spelled(names, SRC / "rundir.py", "a run-folder file")
    assert not broken, "\n".join(broken)


def default_paths() -> dict[str, str]:
    return {k: str(v) for k, v in vars(paths).items() if k.isupper() and isinstance(v, Path)}


def test_default_paths_are_dvc_yamls_and_spelled_in_paths_alone():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    tokens = {t for stage in stages.values() for t in str(stage["cmd"]).split()}
    missing = {k: v for k, v in default_paths().items() if v not in tokens and k not in ("SWEEPS", "DVC_YAML")}
    assert not missing, f"src/draftlab/paths.py: {missing} are not the paths dvc.yaml's stages pass"
    spelled = {v for v in default_paths().values() if "/" in v}  # "params.yaml" is also a trial's file name
    broken = _spelled(spelled, SRC / "paths.py", "a default path")
    assert not broken, "\n".join(broken)


def test_every_mlflow_client_is_built_in_tracking():
    broken = []
    for path in _modules():
        if path == SRC / "tracking.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name.endswith("MlflowClient") or name in ("mlflow.set_tracking_uri", "mlflow.tracking.MlflowClient"):
                    broken.append(f"{_where(path, node.lineno)}: builds {name}(…); take tracking.client()")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlflow"):
                if any(a.name == "MlflowClient" for a in node.names):
                    broken.append(f"{_where(path, node.lineno)}: imports MlflowClient; take tracking.client()")
    assert not broken, "\n".join(broken)


SPECULATORS_SEAMS = {SRC / "training" / "compat.py", SRC / "store" / "hidden_states.py"}


def test_speculators_private_names_are_reached_in_its_two_seams_alone():
    broken = []
    for path in _modules():
        if path in SPECULATORS_SEAMS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("speculators", "hs_connectors"):
                broken += [f"{_where(path, node.lineno)}: imports {node.module}.{a.name}, a private name; reach it "
                           "in training/compat.py or store/hidden_states.py" for a in node.names if a.name.startswith("_")]
    assert not broken, "\n".join(broken)


def test_the_contract_checks_see_a_broken_import(tmp_path, monkeypatch):
    """The import reader finds lazy imports inside functions and names the line."""
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    x = 1\n    from draftlab.stages import train\n")
    assert draftlab_imports(bad) == [(3, "stages.train")]
