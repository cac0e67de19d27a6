#!/usr/bin/env bash
# Install draftlab and its pinned CPU environment into a fresh virtual environment (.venv).
#
#   scripts/install.sh            # runtime only
#   scripts/install.sh --test     # plus what the test suite needs, and the real vLLM it serves
#                                 # drafts with, in .venv-vllm (scripts/install-vllm.sh)
#
# The CPU lock (requirements/cpu.txt, made by scripts/lock.sh) pins every package with its sha256
# and is installed with --require-hashes and --no-deps, by uv (scripts/lock-install.sh; and so is
# requirements/test.txt, the suite's lock on top of it): speculators declares torchvision and
# torchaudio, which it never imports and which break `import transformers` beside a CPU torch.
# torch is the CPU build, torch==2.13.0+cpu, which PyPI does not serve: it is found in a local
# wheel folder (pip's find-links, which lock-install.sh hands to uv) or, with
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu, on PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV="${VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)

"${PIP[@]}" install --upgrade "pip>=24"
locks=(requirements/cpu.txt)
if [ "${1:-}" = "--test" ]; then locks+=(requirements/test.txt); fi
scripts/lock-install.sh "$VENV" "${locks[@]}"
"${PIP[@]}" install --no-deps --no-build-isolation -e .
# What the CPU lock leaves out by design (requirements/common.txt) but a venv made before may still
# hold: transformers imports scikit-learn and scipy wherever they are installed, about 1 s of CPU
# in every process that imports speculators (docs/figures.md, "What a process imports").
left_out="$("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("scikit-learn", "scipy", "skops", "joblib", "threadpoolctl"):
    try:
        md.version(name)
        print(name)
    except md.PackageNotFoundError:
        pass
PY
)"
if [ -n "$left_out" ]; then
  echo "install: removing $(echo $left_out) from $VENV: the CPU lock leaves them out (requirements/common.txt)"
  # shellcheck disable=SC2086
  "${PIP[@]}" uninstall -y $left_out
fi
# an editable install compiles nothing: draftlab's own modules too, once (see lock-install.sh)
"$VENV/bin/python" -m compileall -q src >/dev/null

# Fail here, not in the first stage, if the environment is broken.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, sys
import torch, transformers  # noqa: F401  (transformers breaks here if a stray torchvision is present)
for name, want in {"torch": "2.13.0", "speculators": "0.9.0", "transformers": "5.19.0"}.items():
    got = md.version(name).split("+")[0]
    if got != want:
        sys.exit(f"install: {name} is {got}, expected {want}")
for stray in ("torchvision", "torchaudio"):
    try:
        md.version(stray)
        sys.exit(f"install: {stray} is installed; it breaks transformers beside a CPU torch — remove it")
    except md.PackageNotFoundError:
        pass
print(f"installed: torch {torch.__version__}, transformers {transformers.__version__}, draftlab into {sys.prefix}")
PY
if [ "${1:-}" = "--test" ]; then
  scripts/install-vllm.sh
fi
