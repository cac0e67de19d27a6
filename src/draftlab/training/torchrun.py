"""torch's elastic launcher (`torch.distributed.run`, flags unchanged) that leaves without the
interpreter's teardown once its ranks are done.

    python -m draftlab.training.torchrun --standalone --nproc-per-node 2 -m draftlab.training.rank …

Tearing down an interpreter that imported torch took about a second on a loaded 2-core VM: time
after the last step that every training's tail, ETA and plan pay. The launcher's own work
(rendezvous shutdown, exit barrier, error records) is inside `torch.distributed.run.main` and
runs as before; only the teardown of loaded modules is skipped (atexit handlers still run).
"""

from __future__ import annotations

import atexit
import os
import sys


def main() -> None:
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
