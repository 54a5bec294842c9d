"""Host-wide allocation of sandbox id ranges (isolation/idranges.py), with real processes
as holders and real flock(2) locks between allocators (as between two edges of a host)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsec import errors
from dsec.isolation import linux
from dsec.isolation.idranges import RANGE, IdRanges


def test_ranges_lie_above_the_store_range_and_never_overlap(tmp_path):
    a = IdRanges(tmp_path, 100000 + RANGE)
    b = IdRanges(tmp_path, 100000 + RANGE)  # another edge on the same host
    got = [a.claim() for _ in range(5)] + [b.claim() for _ in range(5)]
    bases = [r.base for r in got]
    assert len(set(bases)) == 10
    assert all(x % RANGE == 0 and x >= 100000 + RANGE for x in bases)
    assert max(bases) + RANGE - 1 < 1 << 32
    for r in got:
        r.release()


def test_a_released_range_is_free_again_for_everyone(tmp_path):
    a, b = IdRanges(tmp_path, 200000), IdRanges(tmp_path, 200000)
    first = a.claim()
    b._next = first.slot  # b would scan from that very range
    taken = b.claim()
    assert taken.base != first.base  # locked by a
    taken.release()
    first.release()
    b._next = first.slot
    again = b.claim()
    assert again.base == first.base
    again.release()


def test_a_live_holder_keeps_its_range_after_its_edge_let_go(tmp_path):
    """The edge dies (its lock goes) while the sandbox's init lives: nobody takes the range."""
    a = IdRanges(tmp_path, 200000)
    r = a.claim()
    init = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = linux.proc_start_time(init.pid)
        assert start is not None
        r.bind(init.pid, start)
        r.release(keep_holder=True)  # like an edge that exits with the sandbox still running
        b = IdRanges(tmp_path, 200000)
        taken = [b.claim() for _ in range(3)]
        assert r.base not in {t.base for t in taken}
        for t in taken:
            t.release()
        # the edge that comes back adopts it (the holder is the sandbox it adopts)...
        back = b.adopt(r.base, init.pid, start)
        assert back is not None and back.base == r.base
        # ...and while it holds it, nobody else can
        assert a.adopt(r.base, init.pid, start) is None
        back.release(keep_holder=True)
    finally:
        init.kill()
        init.wait()
    # the holder is gone: the range is free
    c = IdRanges(tmp_path, 200000)
    c._next = r.slot
    again = c.claim()
    assert again.base == r.base
    again.release()


def test_adopt_refuses_a_base_that_is_no_range(tmp_path):
    a = IdRanges(tmp_path, 200000)
    assert a.adopt(100000, 1, 1) is None  # the store's own range
    assert a.adopt(a.first_slot * RANGE + 5, 1, 1) is None  # not aligned


def test_every_range_in_use_is_capacity_exhausted(tmp_path):
    a = IdRanges(tmp_path, (1 << 32) - 4 * RANGE)
    held = [a.claim() for _ in range(a.count)]
    with pytest.raises(errors.CapacityExhausted):
        a.claim()
    for r in held:
        r.release()
    with pytest.raises(errors.InvalidRequest):
        IdRanges(tmp_path, (1 << 32) - RANGE)
