#!/usr/bin/env bash
# Run the test suite, both tiers (installs into .venv first if needed). Extra args go to pytest:
# `scripts/test.sh -m "not integration"` runs the fast tier (tests/unit) alone.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
exec .venv/bin/python -m pytest "$@"
