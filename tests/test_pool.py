"""The rank pool: reuse, deadlines and hang reports, errors, wrong shapes, leaks, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness.case import make_case
from harness.ranks.pool import RankPool
from harness.runner import run_case


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_dead(pids, timeout=10.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture
def pool():
    p = RankPool(2)
    yield p
    pids = p.pids()
    p.close()
    assert _wait_dead(pids) == []


def test_pool_is_reused_across_cases(pool):
    cases = [
        make_case(world_size=w, total_len=9, mask={"kind": "causal"}, seed=s) for s, w in enumerate((2, 1, 2))
    ]
    results = [run_case(c, pool) for c in cases]
    assert [r.verdict for r in results] == ["pass"] * 3
    assert pool.starts == 1
    assert [r.timings["pool_restarted"] for r in results] == [True, False, False]


def test_hang_is_reported_within_deadline_and_pool_heals(pool):
    c = make_case(world_size=2, total_len=8, deadline_s=3.0)
    run_case(c, pool)
    old = pool.pids()
    t0 = time.monotonic()
    r = run_case(c, pool, "tests.impls:hang", allow_import=True)
    took = time.monotonic() - t0
    assert r.verdict == "hang"
    assert took < 3.0 + 8.0
    assert set(r.hung) == {0, 1}
    assert all("_hang" in s and "impls.py" in s for s in r.hung.values())
    assert _wait_dead(old) == []  # the hung workers were killed, not leaked
    assert run_case(c, pool).verdict == "pass"
    assert pool.starts == 2


def test_raising_implementation_is_fail_stop_naming_the_rank(pool):
    r = run_case(make_case(world_size=2, total_len=6), pool, "tests.impls:raises", allow_import=True)
    assert r.verdict == "fail-stop"
    assert r.errors[1].startswith("RuntimeError: deliberate failure on rank 1")
    assert "rank 0" in r.detail and "rank 1" in r.detail


def test_wrong_shape_is_diverged(pool):
    r = run_case(make_case(world_size=2, total_len=6), pool, "tests.impls:wrong_shape", allow_import=True)
    assert r.verdict == "diverged" and "output shape" in r.detail


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_leak_check_catches_a_wrong_mask(pool, layout):
    c = make_case(world_size=2, total_len=12, layout=layout, mask={"kind": "causal"}, seed=4)
    r = run_case(c, pool, "tests.impls:leaky", allow_import=True)
    assert r.verdict == "silent-corruption"
    assert r.leak is not None and not r.leak.passed
    assert run_case(c, pool).leak.passed


def test_tolerance_rule_rejects_a_small_output_error(pool):
    c = make_case(world_size=2, total_len=12, mask={"kind": "causal"})
    r = run_case(c, pool, "tests.impls:perturbed", allow_import=True)
    assert r.verdict == "silent-corruption"
    assert {ch.tensor for ch in r.failed_checks()} == {"out"}
    assert all(ch.ratio > 10 for ch in r.failed_checks())


def test_workers_die_with_their_parent(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from harness.ranks.pool import RankPool
        p = RankPool(2); p.start()
        print(" ".join(map(str, p.pids())), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert _wait_dead(pids) == []
