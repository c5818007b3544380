"""Which ranks a case goes to (issue #55): its ring's, once every rank has made its group.

`new_group` is collective over the whole pool, so a group's first case wakes every rank; the idle
ones build the group and reply "idle". Later cases of that group go to its ring's ranks only.
"""

from __future__ import annotations

import pytest

from harness.case import make_case
from harness.ranks.pool import RankPool
from harness.runner import run_case


@pytest.fixture(scope="module")
def pool():
    with RankPool(4) as p:
        yield p


def _replied(pool, case) -> list[int]:
    return sorted(pool.collect(pool.submit(case)).replies)


def test_a_known_groups_case_wakes_its_ring_alone(pool):
    sub = make_case(world_size=2, total_len=9, mask={"kind": "causal"}, group_offset=1)
    assert _replied(pool, sub) == [0, 1, 2, 3]  # the group's first case: every rank makes it
    assert _replied(pool, sub.replace(seed=5)) == [1, 2]
    assert run_case(sub.replace(seed=6), pool).verdict == "pass"
    # another ring size is another group: every rank again
    assert _replied(pool, make_case(world_size=3, total_len=9, seed=1)) == [0, 1, 2, 3]


def test_a_fresh_group_after_a_failed_case_wakes_every_rank(pool):
    case = make_case(world_size=2, total_len=9, mask={"kind": "causal"}, seed=2)
    run_case(case, pool)
    assert _replied(pool, case.replace(seed=3)) == [0, 1]
    pool.fresh_group = True  # what a case whose ranks raised mid-ring leaves
    assert _replied(pool, case.replace(seed=4)) == [0, 1, 2, 3]
    assert _replied(pool, case.replace(seed=5)) == [0, 1]
    assert run_case(case.replace(seed=7), pool).verdict == "pass"
