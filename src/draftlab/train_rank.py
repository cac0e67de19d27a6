"""One training rank: speculators' trainer, patched for this machine's device.

    torchrun --nproc-per-node N -m draftlab.train_rank <speculators train flags>

Takes exactly the flags of ``speculators train`` (see draftlab.compat).
"""

import sys

from draftlab.compat import run_trainer

if __name__ == "__main__":
    run_trainer(sys.argv[1:])
