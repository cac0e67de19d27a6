"""draftlab: reproducible EAGLE-3 draft training on speculators 0.9 (`dvc repro`, MLflow, Optuna).

`src/draftlab/` is laid out by concern: one package per concern, each `__init__` saying what it
owns and what it may import, and the top, which is of two kinds:

    the shared core   params, paths, rundir, errors, procs, threads, tracking, console, util,
                      strict_yaml, devices, models, generation, corpus, pinned: what every
                      package may use; it imports only itself
    entry points      `cli`, `status`, `summary`: commands over everything; nothing imports them

Entry points: `cli`, `status`, `summary`.

tests/unit/test_contracts.py reads every import (those inside functions too) and fails, naming the
file and line, when a module imports what its package's "May import:" line does not name, when a
core module imports a package, or when two packages import each other.
"""
