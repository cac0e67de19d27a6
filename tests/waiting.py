"""Waiting in integration tests on a condition the test controls, never on the host's speed."""
from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float, what: str, proc=None, poll_s: float = 0.1):
    """`predicate()`'s first truthy value; fails naming `what` after `timeout_s`, or at once when
    `proc` (a Popen with stdout piped) ends first."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"ended before {what}: {proc.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(poll_s)
    return value
