#!/usr/bin/env bash
# Run the test suite, both tiers (installs into .venv first if needed). Extra args go to pytest:
# `scripts/test.sh -m "not integration"` runs the fast tier (tests/unit) alone.
#
# The suite runs on one pytest-xdist worker per CPU, at most 4 (DRAFTLAB_TEST_WORKERS sets it;
# `-n 0` among the args runs it in this process), each worker taking whole test files
# (--dist loadfile: a file's module fixtures, its vLLM servers, start once). Most integration tests
# hold one CPU (a stage, a server's start, one rank), so a second worker fills the other
# (docs/quickstart.md has the tiers' times).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test
workers="${DRAFTLAB_TEST_WORKERS:-$(nproc)}"
[ "$workers" -le 4 ] || workers=4
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
