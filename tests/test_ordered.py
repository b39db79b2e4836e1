"""Tier 2: the CPU transport holds each gloo group's operations to issue order, as NCCL does on GPUs.

gloo alone matches by (peer, tag), so the boundary pattern that hangs on NCCL (one group for both directions)
would pass on CPU and hide the bug; under hethub's ordered transport it hangs here too, and ends at the timeout
with one line per rank naming its peer.
"""
import os

import pytest

from dist_util import spawn

pytestmark = pytest.mark.dist

WORKER = os.path.join("tests", "workers", "ordered_pair.py")


def test_both_directions_on_one_gloo_group_deadlock_as_on_nccl_and_end_with_one_line():
    results = spawn(2, [WORKER, "one"], timeout=60)
    for rank, (rc, _out, err) in enumerate(results):
        assert rc == 3, f"rank {rank}: {err[-2000:]}"
        lines = [l for l in err.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and f"rank {rank} (stage {rank}) lost rank(s) {1 - rank} during the toy exchange" \
            in lines[0], err[-2000:]


def test_one_group_per_direction_completes_in_order():
    results = spawn(2, [WORKER, "two"], timeout=60)
    outs = []
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank}: {err[-2000:]}"
        outs.append(out.strip().splitlines()[-1])
    assert outs == ["received [20.0]", "received [10.0, 11.0]"]
