"""Write the parts of docs/ that a program can produce, so that none is copied by hand.

- `docs/params.md`: the params reference, from the params model (`draftlab.params.Params`),
  the same fields, defaults and descriptions `draftlab params` prints;
- `docs/cli.md`: `draftlab --help` and every command's `--help`, as the CLI prints them;
- the regions between `<!-- generated: NAME -->` and `<!-- /generated -->` in any docs page:
  the output of the command `BLOCKS[NAME]` runs (e.g. `draftlab plan` of the Kimi-K2.5 profiles).

    python scripts/gen_docs.py           # rewrite what is out of date
    python scripts/gen_docs.py --check   # exit 1 naming each page that differs (tests/unit/test_docs.py)
    python scripts/gen_docs.py --tiny-run DIR   # also the tiny default's figures, from a checkout
                                                # where `dvc repro` of the default has run (minutes;
                                                # tests/integration/test_docs_figures.py does that)

The `RUN_BLOCKS` regions need such a finished run: without `--tiny-run` they are left as they are.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import tempfile
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
HELP_WIDTH = 100
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
REGION = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)

# What `draftlab plan` is told about the host in the pages: the figures then depend on the
# profile and the stated reference rates alone, not on the disk or /dev/shm of whoever runs this.
PLAN_DISK_FREE_TIB = 8
PLAN_SHM_MB = 64_000
# The Kimi-K2.5 reference run (DESIGN.md): 37,312 samples, 87.8 M tokens, H = 7168; training at
# 1.4 steps/s × 4 ranks × 2,353 tokens per rank-step ≈ 13.2 k tokens/s; extraction 2,600 tokens/s.
KIMI_COUNTS = "--samples 37312 --tokens 87800000 --hidden-size 7168"
KIMI_RATES = "--tokens-per-s 13200 --at-gpus 4 --extract-tokens-per-s 2600"


# ------------------------------------------------------------------ the params reference


def _type_name(ann: object) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(ann))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(ann))
        return " \\| ".join(_type_name(a) for a in args) + (" \\| null" if nullable else "")
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in typing.get_args(ann))
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(ann, "__name__", str(ann))


def yaml_value(value: object) -> str:
    """A default as it is written in params.yaml."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def params_page() -> str:
    from pydantic import BaseModel

    from draftlab.params import Params

    out = [
        "# Params reference",
        "",
        "<!-- Written by scripts/gen_docs.py from draftlab.params.Params; do not edit by hand. -->",
        "",
        "Every key of `params.yaml`, its default (the tiny profile) and its meaning: the fields, defaults",
        "and descriptions `draftlab params` prints, from the same model. A key not listed here is refused",
        "with one line naming it and the closest valid key ([errors](errors.md#params)). Real-target",
        "profiles in `experiments/` override some of them (`draftlab use experiments/<profile>.yaml`).",
        "",
    ]

    def section(model: type[BaseModel], prefix: str, title: str, description: str) -> None:
        rows, subsections = [], []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subsections.append((ann, f"{prefix}{name}.", f"{prefix}{name}", field.description or ""))
                continue
            default = field.get_default(call_default_factory=True)
            rows.append(f"| `{prefix}{name}` | `{_cell(yaml_value(default))}` | {_type_name(ann)} "
                        f"| {_cell(field.description or '')} |")
        out.extend([f"## `{title}`" if prefix else f"## {title}", "", description, ""])
        if rows:
            out.extend(["| key | default | type | meaning |", "|---|---|---|---|", *rows, ""])
        for sub in subsections:
            section(*sub)

    for name, field in Params.model_fields.items():
        section(field.annotation, f"{name}.", name, field.description or "")
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------ command output


@contextlib.contextmanager
def _fixed_terminal(cwd: Path, width: int) -> Iterator[None]:
    """Help and tables at `width` columns, no colour, no MLflow store but the one in `cwd`
    (none), and the plan's host facts fixed (PLAN_DISK_FREE_TIB)."""
    import typer.rich_utils as ru

    from draftlab.console import console
    from draftlab.plan import planning

    saved = (ru.MAX_WIDTH, ru.FORCE_TERMINAL, ru.COLOR_SYSTEM, console.width, os.getcwd(),
             os.environ.pop("MLFLOW_TRACKING_URI", None), planning.disk_free_bytes)
    ru.MAX_WIDTH, ru.FORCE_TERMINAL, ru.COLOR_SYSTEM = width, False, None
    console.width = width
    planning.disk_free_bytes = lambda path: PLAN_DISK_FREE_TIB * 2**40
    os.chdir(cwd)
    try:
        yield
    finally:
        ru.MAX_WIDTH, ru.FORCE_TERMINAL, ru.COLOR_SYSTEM, console.width = saved[:4]
        os.chdir(saved[4])
        if saved[5] is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved[5]
        planning.disk_free_bytes = saved[6]


def draftlab(command: str, width: int = HELP_WIDTH) -> str:
    """What `draftlab <command>` prints (stdout and stderr), run in-process in an empty folder,
    with `{root}` in `command` standing for the repository root."""
    from typer.testing import CliRunner

    from draftlab.cli import app

    args = shlex.split(command.format(root=ROOT))
    with tempfile.TemporaryDirectory() as tmp, _fixed_terminal(Path(tmp), width):
        result = CliRunner().invoke(app, args, prog_name="draftlab")
    if result.exception and not isinstance(result.exception, SystemExit):
        raise RuntimeError(f"draftlab {command}: {result.exception!r}") from result.exception
    text = ANSI.sub("", result.output).replace(str(ROOT) + "/", "")  # no colour, even under FORCE_COLOR
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n") + "\n"


def cli_page() -> str:
    from draftlab.cli import app

    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    out = [
        "# Command reference",
        "",
        "<!-- Written by scripts/gen_docs.py from the CLI itself; do not edit by hand. -->",
        "",
        "Each command's `--help`, as `draftlab` prints it. The stage commands take `--params` (default",
        "`params.yaml`) and the explicit folders `dvc.yaml` passes them; knobs live in params",
        "([params reference](params.md)).",
        "",
        "## `draftlab`",
        "",
        "```text",
        draftlab("--help").rstrip(),
        "```",
        "",
    ]
    for name in names:
        out += [f"## `draftlab {name}`", "", "```text", draftlab(f"{name} --help").rstrip(), "```", ""]
    return "\n".join(out).rstrip() + "\n"


PLAN_WIDTH = 120


def _plan_command(profile: str, gpus: str) -> str:
    return (f"plan --params {{root}}/experiments/{profile} {KIMI_COUNTS} {KIMI_RATES} --gpus {gpus} "
            f"--shm-mb {PLAN_SHM_MB}")


def _plan(profile: str, gpus: str) -> Callable[[], str]:
    command = _plan_command(profile, gpus)

    def block() -> str:
        shown = command.replace("{root}/", "")
        return f"```text\n$ draftlab {shown}\n{draftlab(command, PLAN_WIDTH)}```\n"

    return block


def _kimi_steps() -> str:
    """The journey's table of steps, its costs read from `draftlab plan --json` of both profiles."""
    import json

    four = json.loads(draftlab(_plan_command("kimi-k2.5-4gpu.yaml", "4") + " --json"))
    eight = json.loads(draftlab(_plan_command("kimi-k2.5-8gpu.yaml", "8") + " --json"))
    (row4,), (row8,) = four["rows"], eight["rows"]
    epochs = four["scenario"]["epochs"]

    def train(row: dict) -> str:
        return f"{row['wall_clock_s'] / 3600:.1f} h on {row['gpus']} GPUs ({row['gpu_hours']:.1f} GPU-hours)"

    rate = float(KIMI_RATES.split("--extract-tokens-per-s ")[1].split()[0])
    rows = [
        ("0. prove the host", "`scripts/gpu-check.sh`", "within 6 minutes (its own bound)"),
        ("1. plan", "`draftlab plan …` (below)", "seconds; writes nothing"),
        ("2. choose the profile", "`draftlab use experiments/kimi-k2.5-4gpu.yaml`", "—"),
        ("3. prepare", "`dvc repro prepare`", "not predicted (regeneration by a vLLM server of the target)"),
        ("4. extract", "`dvc repro extract`",
         f"a {four['store_bytes'] / 2**40:.2f} TiB store; {four['extraction_hours']:.1f} h at {rate:,.0f} tokens/s"),
        ("5. train", "`dvc repro train`", f"{epochs} epochs: {train(row4)}, {train(row8)}, at the reference rate"),
        ("6. evaluate", "`dvc repro evaluate`", "not predicted"),
        ("7. export and serve", "`dvc repro export`, then `vllm serve …`", "not predicted"),
    ]
    out = ["| step | command | cost at the reference (`draftlab plan`) |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out) + "\n"


def _serve_kimi() -> str:
    from draftlab.params import load_params
    from draftlab.serve.draft_export import serve_command

    p = load_params(ROOT / "experiments" / "kimi-k2.5-8gpu.yaml", check_paths=False)
    return f"```bash\n{serve_command(p.export.verifier_path, 'models/draft', p.train.ttt_steps)}\n```\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "serve-kimi": _serve_kimi,
    "kimi-steps": _kimi_steps,
    "plan-kimi-4gpu": _plan("kimi-k2.5-4gpu.yaml", "4"),
    "plan-kimi-8gpu": _plan("kimi-k2.5-8gpu.yaml", "4,8"),
    "help-sweep": lambda: f"```text\n$ draftlab sweep --help\n{draftlab('sweep --help')}```\n",
}


def tiny_default_figures(run_root: Path) -> str:
    """What `dvc repro` of the default params produced in `run_root`: the draft's learning and
    its acceptance, read from the run's own outputs (train accounting, step records, validation
    after each epoch, reports/metrics.json)."""
    import json

    a = json.loads((run_root / "runs/train/accounting.json").read_text())
    m = json.loads((run_root / "reports/metrics.json").read_text())
    first = json.loads((run_root / "runs/train/metrics.jsonl").read_text().splitlines()[0])
    epochs = len(a["steps_per_epoch"])
    val = [json.loads((run_root / f"runs/train/checkpoints/{e}/val_metrics.json").read_text())["cond_acc_0_epoch"]
           for e in range(epochs)]
    k = int(m["eval/num_speculative_tokens"])
    steps = sorted(set(a["steps_per_epoch"]))
    per_epoch = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"
    full = " / ".join(f"{m[f'eval/full_acc_{i}']:.3f}" for i in range(k))
    accept = " / ".join(f"{m[f'eval/accept_rate_{i}']:.3f}" for i in range(k))
    identical = "identical to" if m["eval/lossless"] == 1.0 else "NOT identical to"
    return (
        f"- setup: {a['world_size']} CPU rank, {epochs} epochs × {per_epoch} packed steps of ≤ "
        f"{a['total_seq_len']:,} tokens, {a['train_samples']} train samples;\n"
        f"- the draft's `cond_acc_0`: {first['train/cond_acc_0']:.3f} at step 0, {val[0]:.3f} on the validation "
        f"split after epoch 1, {val[-1]:.3f} after epoch {epochs};\n"
        f"- k = {k}: predicted acceptance length {m['eval/simulated_acc_len']:.3f} (val full_acc {full}), measured "
        f"{m['eval/measured_acc_len']:.3f} on {int(m['eval/prompts'])} held-out prompts (acceptance {accept} by "
        f"position), predicted/measured {m['eval/predicted_over_measured']:.2f}, "
        f"{m['eval/forward_passes_saved_frac']:.0%} fewer target forward passes than plain decoding, and output "
        f"{identical} the target's greedy output.\n"
    )


# Regions that need a finished run of the pipeline (see `main`): name -> (run_root -> text).
RUN_BLOCKS: dict[str, Callable[[Path], str]] = {"tiny-default": tiny_default_figures}


def fill_regions(text: str, blocks: dict[str, Callable[[], str]] = BLOCKS, run_root: Path | None = None) -> str:
    def replace(m: re.Match) -> str:
        name = m["name"]
        if name in RUN_BLOCKS:
            return m.group(1) + RUN_BLOCKS[name](run_root) + m.group(4) if run_root else m.group(0)
        if name not in blocks:
            raise KeyError(f"<!-- generated: {name} -->: no such block (scripts/gen_docs.py BLOCKS: {sorted(blocks)})")
        return m.group(1) + blocks[name]() + m.group(4)

    return REGION.sub(replace, text)


# ------------------------------------------------------------------ the pages


def region(text: str, name: str) -> str:
    """The body of the region `name` in a page's text."""
    m = re.search(rf"<!-- generated: {re.escape(name)} -->\n(.*?)<!-- /generated -->", text, re.S)
    if m is None:
        raise KeyError(f"no <!-- generated: {name} --> region")
    return m[1]


def expected_pages(run_root: Path | None = None) -> dict[Path, str]:
    """Every generated page or page with generated regions, as this code would write it."""
    pages = {DOCS / "params.md": params_page(), DOCS / "cli.md": cli_page()}
    for page in sorted(DOCS.rglob("*.md")):
        if page in pages:
            continue
        text = page.read_text()
        if REGION.search(text):
            pages[page] = fill_regions(text, run_root=run_root)
    return pages


def stale_pages() -> list[Path]:
    return [p for p, text in expected_pages().items() if not p.is_file() or p.read_text() != text]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        stale = stale_pages()
        for page in stale:
            print(f"{page.relative_to(ROOT)}: out of date; run `python scripts/gen_docs.py`", file=sys.stderr)
        return 1 if stale else 0
    run_root = None
    if len(argv) == 2 and argv[0] == "--tiny-run":
        run_root, argv = Path(argv[1]).resolve(), []
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    for page, text in expected_pages(run_root).items():
        if not page.is_file() or page.read_text() != text:
            page.write_text(text)
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
