"""benchmarks/_common.py's traffic summary at every world size, world size 1 included.

``benchmarks/gpu.py`` at world size 1 (one lent GPU) crashed in ``wire_summary`` with a division
by zero: a ring sends (N-1)/N of a buffer, and its point-to-point bytes were converted back by
dividing by that factor.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import _common as C  # noqa: E402


def test_wire_summary_at_world_size_one():
    """Collectives are counted but nothing crosses a wire; no point-to-point traffic exists."""
    coll = C.summarize_records(
        [("all_gather_single", "all_gather", 400, None), ("all_reduce", "all_reduce", 40, None)], 2)
    w = C.wire_summary(coll, 1)
    assert w["buffer_bytes_by_kind"] == {"all_gather": 200, "reduce_scatter": 0.0, "all_reduce": 20, "broadcast": 0.0}
    assert w["buffer_bytes"] == 220 and w["ring_sent_bytes"] == 0
    assert C.wire_summary(C.summarize_records([], 3), 1)["buffer_bytes"] == 0


@pytest.mark.parametrize("ws", [2, 4])
def test_wire_summary_converts_point_to_point_bytes(ws):
    """A gloo reduce-scatter built from sends: (N-1)/N of its buffer is sent, reported as the buffer."""
    sent = 300 * (ws - 1)  # a 300*ws-byte reduce-scatter buffer
    coll = C.summarize_records([("isend", "p2p", sent, None)], 1)
    w = C.wire_summary(coll, ws)
    assert w["buffer_bytes_by_kind"]["reduce_scatter"] == pytest.approx(300 * ws)
    assert w["ring_sent_bytes"] == pytest.approx(sent)
