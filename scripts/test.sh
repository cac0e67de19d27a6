#!/usr/bin/env bash
# Run the test suite (installs into .venv first if needed). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
exec .venv/bin/python -m pytest "$@"
