#!/usr/bin/env bash
# Prove a GPU host in one command, in at most 6 minutes: the tiny pipeline end to end on the GPU,
# nccl training on 1 rank (and DDP/FSDP2 on 2 where 2 GPUs are visible), GPU-vs-CPU extraction,
# vLLM serving where vllm is importable. Prints a pass/fail table and writes it as JSON after
# every step (see src/draftlab/gpucheck/check.py).
#
#   scripts/gpu-check.sh [--out reports/gpu-check.json] [--wheels DIR]
#
# Uses the Python it finds ($PYTHON, else python3, else python) with whatever torch, transformers
# and speculators that Python has; installs nothing but the local wheels given with --wheels (no
# index, no network). Exit 0: all passed or skipped for a stated reason; 1: a step failed;
# 4: no CUDA device here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
OUT=reports/gpu-check.json
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    *) echo "gpu-check: unknown argument $1 (use --out FILE, --wheels DIR)" >&2; exit 2 ;;
  esac
done
if [ -z "$PY" ]; then echo "gpu-check: no python found; set PYTHON" >&2; exit 2; fi
if [ -n "$WHEELS" ]; then
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then echo "gpu-check: no .whl files in $WHEELS" >&2; exit 2; fi
  timeout 120 "$PY" -m pip install --no-index --find-links "$WHEELS" "${wheels[@]}" \
    || echo "gpu-check: installing the wheels of $WHEELS failed; checking with what is installed" >&2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 DVC_NO_ANALYTICS=1
exec timeout -k 10 360 "$PY" -m draftlab.gpucheck.check --out "$OUT"
