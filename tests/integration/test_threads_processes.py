"""Thread budgets as started processes see them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from draftlab import threads


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_usable_cpus_follows_the_affinity_mask():
    code = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); " \
           "from draftlab import threads; print(threads.usable_cpus())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_torch_in_a_started_process_uses_the_share(tmp_path):
    env = threads.thread_env(1, dict(os.environ), total=1)
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
