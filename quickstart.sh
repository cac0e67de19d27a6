#!/usr/bin/env bash
# One command from a fresh clone: install into .venv, run the whole pipeline on the tiny default
# (`dvc repro`), and say what was produced and where to look.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
if [ ! -d .git ]; then git init -q; fi
if [ ! -d .dvc ]; then dvc init -q; fi
# DVC hashes the store with core.checksum_jobs threads (its default: at most 4): one per core
# (.dvc/config.local is per host, never committed)
dvc config --local core.checksum_jobs "$(nproc)"
dvc repro
draftlab summary
