"""The docs agree with the code: the site builds with `mkdocs build --strict` (a broken link or a
page missing from the nav fails), the generated pages are what scripts/gen_docs.py writes now
(the params reference, every `--help`, the plan figures), the params page and `draftlab params`
show the same keys and defaults, docs/errors.md quotes every error the code can print, and the
docs toolchain is pinned."""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    return _script("gen_docs")


@pytest.fixture(scope="module")
def error_sites():
    return _script("error_sites")


# ------------------------------------------------------------------ the site


def test_the_site_builds_strict(tmp_path):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # strict: any warning (a broken link, a nav entry without its page) raises
    home = (tmp_path / "site" / "index.html").read_text()
    assert "./quickstart.sh" in home and "./scripts/test.sh" in home, "the home page is the README"
    for page in ("quickstart", "gpu-host", "comparing-runs", "sweeps", "teams", "container", "errors",
                 "figures", "params", "cli"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The check above can fail: a page linking to a page that does not exist stops the build."""
    import shutil

    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "quickstart.md").write_text((docs / "quickstart.md").read_text() + "\n[gone](no-such-page.md)\n")
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    cfg["docs_dir"] = str(docs)
    cfg["hooks"] = [str(ROOT / h) for h in cfg["hooks"]]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(cfg))
    config = load_config(str(tmp_path / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    with pytest.raises(Abort):
        build(config)


def test_the_readme_stays_short_and_leads_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    head = "\n".join(text.splitlines()[:25])
    assert "./quickstart.sh" in head and "./scripts/test.sh" in head
    assert "draftlab: what was produced" in head and "passed" in head, "what the two commands print on success"
    # the table title the README quotes is the one `draftlab summary` prints
    assert '"draftlab: what was produced"' in (ROOT / "src" / "draftlab" / "summary.py").read_text()


# ------------------------------------------------------------------ generated pages


def test_generated_pages_are_current(gen):
    stale = gen.stale_pages()
    assert not stale, (f"{', '.join(str(p.relative_to(ROOT)) for p in stale)} differ from what the code "
                       "produces now; run `python scripts/gen_docs.py` and commit the result")


def test_the_plan_figures_in_the_gpu_host_page_come_from_draftlab_plan(gen):
    page = (ROOT / "docs" / "gpu-host.md").read_text()
    for name in ("plan-kimi-4gpu", "plan-kimi-8gpu"):
        body = re.search(rf"<!-- generated: {name} -->\n(.*?)<!-- /generated -->", page, re.S)[1]
        assert "draftlab plan --params experiments/kimi-k2.5-" in body and "4.58 TiB" in body
        assert "wall-clock" in body and "measurements: no MLflow store" in body


def test_the_params_page_and_draftlab_params_agree():
    """Two renderings of one model: every key `draftlab params` prints is on the page with the
    same default, and the page has no key it does not print."""
    from draftlab.cli import app

    printed = {}
    for line in CliRunner().invoke(app, ["params"]).output.splitlines():
        m = re.match(r"  (\S+) = (.*?)  —  ", line)
        if m:
            printed[m[1]] = ast.literal_eval(m[2])
    page = {}
    for line in (ROOT / "docs" / "params.md").read_text().splitlines():
        m = re.match(r"\| `([\w.]+)` \| `(.*?)` \| ", line)
        if m:
            page[m[1]] = yaml.safe_load(m[2].replace("\\|", "|"))
    assert len(printed) > 50 and page.keys() == printed.keys()
    differ = {k: (page[k], printed[k]) for k in printed if page[k] != printed[k]}
    assert not differ


def test_every_command_has_its_help_on_the_commands_page():
    from draftlab.cli import app

    page = (ROOT / "docs" / "cli.md").read_text()
    for command in app.registered_commands:
        assert f"## `draftlab {command.name or command.callback.__name__}`" in page


# ------------------------------------------------------------------ errors


def _documented(page: str) -> tuple[set[str], set[str]]:
    """The `error:` lines of the ```text blocks, and the `built:` markers."""
    lines = set()
    for block in re.findall(r"^```text\n(.*?)^```", page, re.S | re.M):
        lines.update(line for line in block.splitlines() if line.startswith("error: "))
    built = set(re.findall(r"<!-- built: (.*?) -->", page))
    return lines, built


def _decorated(site) -> bool:
    """Sites whose message the user sees inside a longer line: a validator's (after the file
    and key) and a failure record's (inside `train: …; see …`)."""
    return site.error in ("ValueError", "Failure")


def _covers(line: str, site) -> bool:
    body = line.removeprefix("error: ")
    return site.template in body if _decorated(site) else body == site.template


def _built_key(site) -> str:
    return f"{site.path} {site.function} {site.source}"


def test_every_user_facing_error_has_an_entry(error_sites):
    sites = error_sites.sites()
    assert len(sites) > 100, "the scan finds the error sites"
    lines, built = _documented((ROOT / "docs" / "errors.md").read_text())
    missing = []
    for s in sites:
        if s.template is None:
            if _built_key(s) not in built:
                missing.append(f"  {s.where()}: its message is built from `{s.source}`; add to the entry "
                               f"that explains it the line\n      <!-- built: {_built_key(s)} -->")
        elif not any(_covers(line, s) for line in lines):
            shown = (f"…: <key>: {s.template}" if s.error == "ValueError"
                     else f"train: {s.template}; see …" if s.error == "Failure" else s.template)
            missing.append(f"  {s.where()}: add to the ```text block of the entry that explains it (or a new "
                           f"### entry with **Cause.** and **Remedy.**) the line\n      error: {shown}")
    assert not missing, "docs/errors.md lacks entries:\n" + "\n".join(missing)


def test_no_entry_for_an_error_the_code_no_longer_prints(error_sites):
    sites = error_sites.sites()
    lines, built = _documented((ROOT / "docs" / "errors.md").read_text())
    stale = [f"  {line}" for line in sorted(lines)
             if not any(s.template is not None and _covers(line, s) for s in sites)]
    stale += [f"  <!-- built: {b} -->" for b in sorted(built - {_built_key(s) for s in sites if s.template is None})]
    assert not stale, ("docs/errors.md quotes lines no code prints any more (the message changed or went); "
                       "update or remove them:\n" + "\n".join(stale))


def test_the_scan_finds_a_new_error_and_names_the_line_to_add(error_sites, tmp_path, monkeypatch):
    """What a developer sees after adding a user error without its entry."""
    src = tmp_path / "src" / "draftlab"
    src.mkdir(parents=True)
    (src / "errors.py").write_text("class UserError(Exception):\n    pass\nclass HostError(UserError):\n    pass\n")
    (src / "new.py").write_text(
        "from draftlab.errors import HostError\nLIMIT = 'see the limits page'\n\n"
        "def check(n):\n    if n > 3:\n        raise HostError(f'{n} workers asked; at most 3 here ({LIMIT})')\n")
    monkeypatch.setattr(error_sites, "SRC", src)
    (site,) = error_sites.sites()
    assert (site.path, site.line, site.function, site.error) == ("src/draftlab/new.py", 6, "check", "HostError")
    assert site.template == "… workers asked; at most 3 here (see the limits page)"


def test_a_documented_line_is_what_the_cli_prints():
    """The page's premise: the CLI prints `error: <message>`, the message's values where the page has `…`."""
    from draftlab.cli import app

    result = CliRunner().invoke(app, ["plan", "--gpus", "0"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --gpus: expected comma-separated positive integers, got '0'"
    lines, _ = _documented((ROOT / "docs" / "errors.md").read_text())
    assert "error: --gpus: expected comma-separated positive integers, got …" in lines


# ------------------------------------------------------------------ the docs toolchain


def _pins() -> dict[str, str]:
    pins = {}
    for name in ("common.txt", "test.in"):
        for line in (ROOT / "requirements" / name).read_text().splitlines():
            m = re.match(r"([A-Za-z0-9_.-]+)==([^\s#;]+)", line.strip())
            if m:
                pins[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return pins


def test_mkdocs_material_and_all_it_needs_are_pinned():
    """`pip install --no-deps -r requirements/test.txt` (the lock of test.in) must bring everything mkdocs-material
    imports: walk its requirements (for this Python) and find each one pinned."""
    from packaging.requirements import Requirement

    pins, todo, seen, problems = _pins(), ["mkdocs-material"], set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in pins:
            problems.append(f"{name}: not pinned in requirements/common.txt or test.in")
            continue
        for raw in md.requires(name) or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = re.sub(r"[-_.]+", "-", req.name).lower()
            if dep in pins and not req.specifier.contains(pins[dep], prereleases=True):
                problems.append(f"{dep}=={pins[dep]} does not satisfy {name}'s {raw}")
            todo.append(dep)
    assert not problems, problems
    assert {"mkdocs", "mkdocs-material", "pymdown-extensions"} <= seen
