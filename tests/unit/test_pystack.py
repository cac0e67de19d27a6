"""pystack.call: a loop of calls that go in and out at every depth maps no frame-stack chunk anew."""

import resource
import sys

import pytest

from draftlab import pystack


def _down(n: int) -> int:
    return 0 if n == 0 else _down(n - 1) + 1


def _loop_over_depths() -> int:
    """Minor page faults of this thread while calls of every depth up to 400 frames repeat: one
    of them sits at a chunk boundary of the frame stack, wherever the loop starts."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for depth in range(400):
        for _ in range(50):
            _down(depth)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_a_loop_called_through_it_maps_no_chunk_at_any_depth():
    _loop_over_depths()  # the interpreter's own one-off allocations (specialization, caches) first
    assert pystack.call(_loop_over_depths) < 20


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the thrash it avoids is measured on 3.11")
def test_the_same_loop_called_plainly_maps_a_chunk_per_crossing_on_3_11():
    _loop_over_depths()
    assert _loop_over_depths() > 50 * 4  # 50 crossings at the boundary's depth, a 16 KiB chunk each


def test_it_passes_arguments_results_and_exceptions_through():
    assert pystack.call(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="x"):
        pystack.call({}.__getitem__, "x")
