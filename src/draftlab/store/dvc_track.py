"""What DVC versions of the hidden-state store (`extract.dvc_track`), kept in step between
params.yaml and dvc.yaml's `extract` stage.

    files     (default) the whole store folder is extract's output: DVC md5-hashes every
              hs_<i>.safetensors and links it into its cache; `dvc push`/`pull`/`checkout`/`gc`
              work on the store.
    manifest  only `<store>/manifest.json` is extract's output (`cache: false`, `persist: true`):
              DVC hashes one small file and never reads the store; the files are outside DVC
              (move them yourself; `draftlab verify` checks them against the manifest's sha256s).
              For hosts where hashing every new store costs too much. DVC cannot see a
              damaged store file then, so dvc.yaml's `verify` stage is `always_changed` in this
              mode only (in `files` mode DVC's own output check notices a changed file, and
              `dvc status` stays clean while nothing changed).

dvc.yaml cannot pick an output from a param (DVC's templating substitutes values, not choices),
so `draftlab dvc-track MODE` writes both files, and `draftlab extract` refuses to run when they
disagree (`mismatch`).
"""

from __future__ import annotations

from pathlib import Path

from draftlab import paths
from draftlab.rundir import StoreDir

MODES = ("files", "manifest")
STAGE = "extract"
CHECK = "verify"  # the store check before extract: always_changed in manifest mode only


def outs_for(mode: str, store: str, report: str | None = None) -> list:
    """extract's `outs` in dvc.yaml for `mode`, `store` being the stage's `--out` folder and
    `report` its `--report` file. The report is `persist`, which keeps DVC from restoring the
    store from its run-cache: a store DVC sees changed (a damaged file, a bad-files record) is
    re-extracted, not checked out again from cache objects that share its damaged inodes."""
    tail = [{report: {"cache": False, "persist": True}}] if report else []
    if mode == "files":
        return [store, *tail]
    manifest = StoreDir(Path(store)).manifest.path.name  # `store` kept as written in dvc.yaml
    return [{f"{store}/{manifest}": {"cache": False, "persist": True}}, *tail]


def _arg(stage: dict, flag: str, default: str | None) -> str | None:
    words = str(stage.get("cmd", "")).split()
    return words[words.index(flag) + 1] if flag in words[:-1] else default


def _store_arg(stage: dict) -> str:
    return _arg(stage, "--out", str(paths.STORE))


def declared(dvc_yaml: Path) -> str | None:
    """The mode dvc.yaml's extract stage has, or None (no such stage, or outs edited by hand)."""
    import yaml

    try:
        stage = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages", {}).get(STAGE)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(stage, dict):
        return None
    store = _store_arg(stage)
    outs = stage.get("outs") or []
    for mode in MODES:
        if outs == outs_for(mode, store, _arg(stage, "--report", None)):
            return mode
    return None


def mismatch(dvc_yaml: Path, mode: str) -> str | None:
    """One line when dvc.yaml's extract outputs are not what `extract.dvc_track: mode` needs."""
    have = declared(dvc_yaml) if dvc_yaml.is_file() else None
    if have is None or have == mode:
        return None
    return (f"extract.dvc_track is {mode} but {dvc_yaml}'s extract stage tracks the store's {have}: run "
            f"`draftlab dvc-track {mode}` (rewrites both files), then `dvc repro`")


def _round_trip():
    from ruamel.yaml import YAML

    y = YAML()  # round-trip: comments, key order and the files' layout stay
    y.preserve_quotes = True
    y.width = 4096
    y.indent(mapping=2, sequence=4, offset=2)
    y.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return y


def write(mode: str, *, params_yaml: Path, dvc_yaml: Path) -> None:
    """Set `extract.dvc_track: mode` in params.yaml and extract's outs in dvc.yaml to match."""
    import io

    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    from draftlab.util import write_bytes_atomic

    if mode not in MODES:
        raise ValueError(f"extract.dvc_track: {mode!r} is not one of {', '.join(MODES)}")
    y = _round_trip()
    pipeline = y.load(dvc_yaml.read_text())
    stage = (pipeline or {}).get("stages", {}).get(STAGE)
    if stage is None:
        raise ValueError(f"{dvc_yaml}: no `{STAGE}` stage to set the store's outputs on")
    outs = CommentedSeq()
    for out in outs_for(mode, _store_arg(stage), _arg(stage, "--report", None)):
        if isinstance(out, dict):
            (path, opts), = out.items()
            out = CommentedMap({path: CommentedMap(opts)})
        outs.append(out)
    stage["outs"] = outs
    check = pipeline["stages"].get(CHECK)
    if check is not None:
        if mode == "manifest":
            check["always_changed"] = True
        else:
            check.pop("always_changed", None)
    params = y.load(params_yaml.read_text()) or CommentedMap()
    params.setdefault("extract", CommentedMap())["dvc_track"] = mode
    for path, doc in ((dvc_yaml, pipeline), (params_yaml, params)):
        buf = io.StringIO()
        y.dump(doc, buf)
        write_bytes_atomic(path, buf.getvalue().encode())
