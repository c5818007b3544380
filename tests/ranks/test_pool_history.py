"""RankPool.history (issue #19): what the ranks ran since their last start, in order, bounded,
cleared by a (re)start: the raw material of a sequence case."""

from __future__ import annotations

from harness.case import make_case
from harness.ranks import pool as pool_mod
from harness.ranks.pool import RankPool


def test_history_lists_the_runs_since_the_last_start_and_a_restart_clears_it(monkeypatch):
    a = make_case(world_size=1, total_len=2, head_dim=4, seed=1)
    b = a.replace(seed=2)
    with RankPool(1) as pool:
        assert list(pool.history) == []
        pool.run(a)
        pool.run(b, "reference", leak=False)
        assert [(r.case, r.impl, r.leak) for r in pool.history] == [
            (a, "reference", True),
            (b, "reference", False),
        ]
        pool.start()
        assert list(pool.history) == []
        monkeypatch.setattr(pool_mod, "HISTORY_MAX", 2)
    small = RankPool(1)
    try:
        for s in range(3):
            small.run(a.replace(seed=s))
        assert [r.case.seed for r in small.history] == [1, 2]  # bounded: the oldest dropped first
    finally:
        small.close()
