"""`scripts/gpu-check.sh`: one command that proves a GPU host.

    check   `python -m draftlab.gpucheck.check`: runs each step in a child process with a
            timeout, prints the pass/fail table, rewrites the JSON after each step
    steps   the steps themselves; they call the stage functions `dvc repro` calls

Sits above the stages (like the CLI and the sweep): `steps` imports them.

May import: the shared core, `stages`, `store.layout`.
"""
