"""The rank pool: reuse, deadlines and hang reports, errors, wrong shapes, leaks, cleanup, its temp
dir, the Pool protocol, and the leftover-process check."""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from harness.case import make_case
from harness.ranks import protocol, wire, worker
from harness.ranks.leftovers import leftover_workers
from harness.ranks.pool import TMPDIR_ENV, PoolError, RankPool
from harness.ranks.torchrun import TorchrunPool
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
        make_case(world_size=w, total_len=9, mask={"kind": "causal"}, seed=s)
        for s, w in enumerate((2, 1, 2))
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
    r = run_case(c, pool, "tests.helpers.impls:hang", allow_import=True)
    took = time.monotonic() - t0
    assert r.verdict == "hang"
    # the pool stops waiting at the deadline (its own clock: the mechanism, not a guess) ...
    assert 3.0 <= r.timings["wall_s"] < 3.0 + 1.0
    # ... then dumps stacks (1 s grace) and kills the ranks (SIGTERM, 2 s, SIGKILL): a guard against
    # a hang of the harness itself, far above the ~4-6 s this takes on 2 loaded cores
    assert took < 3.0 + 30.0
    assert set(r.hung) == {0, 1}
    assert all("_hang" in s and "impls.py" in s for s in r.hung.values())
    assert _wait_dead(old) == []  # the hung workers were killed, not leaked
    assert run_case(c, pool).verdict == "pass"
    assert pool.starts == 2


def test_raising_implementation_is_fail_stop_naming_the_rank(pool):
    r = run_case(
        make_case(world_size=2, total_len=6), pool, "tests.helpers.impls:raises", allow_import=True
    )
    assert r.verdict == "fail-stop"
    assert r.errors[1].startswith("RuntimeError: deliberate failure on rank 1")
    assert "rank 0" in r.detail and "rank 1" in r.detail


def test_a_rank_killed_by_a_signal_is_reported_with_where_it_died(pool):
    """A SIGSEGV in a C call (gloo given a CUDA tensor did this on an H200, docs/gpu.md):
    faulthandler's report in the rank's log names the Python frames it died in."""
    r = run_case(
        make_case(world_size=2, total_len=6),
        pool,
        "tests.helpers.impls:segfault",
        allow_import=True,
    )
    assert r.verdict == "fail-stop"
    assert all(
        "SIGSEGV" in d and "Fatal Python error" in d and "in _segfault" in d
        for d in r.dead.values()
    ), r.dead
    assert run_case(make_case(world_size=2, total_len=6), pool).verdict == "pass"


def test_wrong_shape_is_diverged(pool):
    r = run_case(
        make_case(world_size=2, total_len=6),
        pool,
        "tests.helpers.impls:wrong_shape",
        allow_import=True,
    )
    assert r.verdict == "diverged" and "output shape" in r.detail


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_leak_check_catches_a_wrong_mask(pool, layout):
    c = make_case(world_size=2, total_len=12, layout=layout, mask={"kind": "causal"}, seed=4)
    r = run_case(c, pool, "tests.helpers.impls:leaky", allow_import=True)
    assert r.verdict == "silent-corruption"
    assert r.leak is not None and not r.leak.passed
    assert run_case(c, pool).leak.passed


def test_tolerance_rule_rejects_a_small_output_error(pool):
    c = make_case(world_size=2, total_len=12, mask={"kind": "causal"})
    r = run_case(c, pool, "tests.helpers.impls:perturbed", allow_import=True)
    assert r.verdict == "silent-corruption"
    assert {ch.tensor for ch in r.failed_checks()} == {"out"}
    assert all(ch.ratio > 10 for ch in r.failed_checks())


def test_workers_die_with_their_parent(tmp_path):
    """The workers, and the zygote they were forked from (harness.ranks.zygote), die with their
    owner."""
    script = textwrap.dedent("""
        import sys, time
        from harness.ranks import zygote
        from harness.ranks.pool import RankPool
        p = RankPool(2); p.start()
        print(" ".join(map(str, [*p.pids(), *zygote.zygote_pids()])), flush=True)
        time.sleep(60)
    """)
    # its temp dir outlives it: keep it in tmp_path
    env = dict(os.environ, **{TMPDIR_ENV: str(tmp_path)})
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        pids = [int(x) for x in parent.stdout.readline().split()]
        # 2 workers (+ the zygote unless forking is off)
        assert len(pids) >= 2 and all(_alive(p) for p in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert _wait_dead(pids) == []


def test_temp_dir_goes_where_the_env_says_and_close_removes_it(monkeypatch):
    # short: the ranks' Unix socket paths must fit in 107 bytes
    short = tempfile.mkdtemp(prefix="rh-")
    monkeypatch.setenv(TMPDIR_ENV, os.path.join(short, "pools"))
    try:
        _temp_dir_goes_where_the_env_says(os.path.join(short, "pools"))
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _temp_dir_goes_where_the_env_says(where: str) -> None:
    with RankPool(1) as p:
        p.start()
        # the worker answers between cases
        wire.send(p.conns[0], protocol.PingMessage(op=protocol.PING))
        assert wire.recv(p.conns[0]) == {"op": protocol.PONG, "rank": 0}
        workdir = p.dir
        assert os.path.dirname(workdir) == where
        assert os.path.basename(workdir).startswith("ring-harness-")
        pids = p.pids()
    assert not os.path.exists(workdir)
    assert _wait_dead(pids) == []


def test_a_pool_that_fails_to_start_leaves_no_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(TMPDIR_ENV, str(tmp_path))
    p = RankPool(1, backend="bogus")  # the worker rejects the backend and exits
    with pytest.raises(PoolError, match="rank 0 exited during rendezvous: exit 1; log: .*bogus"):
        p.start()
    assert p.dir is None and list(tmp_path.iterdir()) == []


def test_both_pools_provide_the_pool_protocol():
    assert isinstance(RankPool(1), protocol.Pool)
    methods = ("submit", "collect", "oracle", "ensure", "pids", "close", "__enter__", "__exit__")
    assert all(callable(getattr(TorchrunPool, m, None)) for m in methods)
    init = inspect.getsource(TorchrunPool.__init__)  # an instance needs torchrun's process group
    assert all(f"self.{a} =" in init for a in ("size", "backend", "broken", "fresh_group"))


def test_the_worker_answers_every_parent_message_with_one_handler():
    assert set(worker.HANDLERS) == {protocol.RUN, protocol.ORACLE, protocol.PING, protocol.STOP}
    assert set(protocol.SETTLED) == {"ok", "idle"}


def _fake_worker(parent: int, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "harness.ranks.worker",
            "--parent",
            str(parent),
        ],
        **kw,
    )


def test_leftover_check_counts_only_the_given_pool():
    """Another pool of this process (the pytest plugin's session pool) is alive: not a leftover of
    the pool under test; the /proc scan, opt-in, sees it."""
    ours, other = _fake_worker(os.getpid(), start_new_session=True), _fake_worker(os.getpid())
    try:
        time.sleep(0.3)
        assert leftover_workers(set(), wait_s=0) == []
        assert [ln.split(":")[0] for ln in leftover_workers({ours.pid}, wait_s=0)] == [
            str(ours.pid)
        ]
        assert leftover_workers({ours.pid}, parent=1, wait_s=0) == []  # a worker of another parent
        assert {int(ln.split(":")[0]) for ln in leftover_workers(set(), wait_s=0, scan=True)} >= {
            ours.pid,
            other.pid,
        }
        ours.kill()
        ours.wait()
        assert leftover_workers({ours.pid}, wait_s=0.5) == []
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


def test_leftover_check_sees_what_a_worker_left_in_its_process_group():
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    w = subprocess.Popen(
        [sys.executable, "-c", script, "harness.ranks.worker", "--parent", str(os.getpid())],
        start_new_session=True,
    )
    try:
        w.wait(timeout=30)  # the worker is gone, its child is still in its group
        left = leftover_workers({w.pid}, wait_s=0)
        assert len(left) == 1 and "time.sleep(60)" in left[0]
    finally:
        try:
            os.killpg(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert leftover_workers({w.pid}, wait_s=5.0) == []


def test_a_rank_that_raises_ends_the_case_on_every_rank_within_seconds(pool):
    """Rank 1 raises 0.5 s into a W=4 case whose other ranks already wait on it: the case is
    fail-stop within 3 s of the raise (not after the process group's timeout, 30 s for a 60 s
    deadline), the root cause is shown first, the other ranks' errors follow as consequences, and
    the next case passes on the healed pool. Measured: ~0.3 s after the raise."""
    c = make_case(world_size=4, total_len=24, mask={"kind": "causal"}, deadline_s=60.0)
    assert run_case(c, pool).passed
    r = run_case(c, pool, "tests.helpers.impls:raise_on_rank1", allow_import=True)
    assert r.verdict == "fail-stop" and not r.hung, r.detail
    assert r.timings["wall_s"] < 0.5 + 3.0, r.timings
    assert r.detail.startswith("rank 1: ValueError: deliberate shape mix-up on rank 1"), r.detail
    assert "consequences: " in r.detail and r.extra["root_cause"] == [1]
    assert run_case(c, pool).passed


def test_a_spare_pool_restarts_on_its_standby_workers():
    """With spare=True a pool that restarted once (after a hang here) starts a standby set, and the
    next restart adopts it: workers that already imported torch, a rendezvous instead of a fresh
    interpreter per rank. A pool that never restarts holds no idle workers (on 2 cores their start
    slowed every check). close() stops them all."""
    c = make_case(world_size=2, total_len=8, deadline_s=3.0)
    with RankPool(2, spare=True) as p:
        assert run_case(c, p).passed and p._standby is None
        assert run_case(c, p, "tests.helpers.impls:hang", allow_import=True).verdict == "hang"
        assert run_case(c, p).passed and p.starts == 2
        standby = [q.pid for q in p._standby.procs]
        assert set(standby).isdisjoint(p.pids())
        assert run_case(c, p, "tests.helpers.impls:hang", allow_import=True).verdict == "hang"
        assert run_case(c, p).passed and p.starts == 3
        assert p.pids() == standby  # the standby set became the pool
        left = p.pids() + [q.pid for q in p._standby.procs]
    assert _wait_dead(left) == []


def test_killing_workers_never_blocks_on_a_popen_lock_left_held():
    """A SIGTERM raised as an exception inside one of Popen's calls can leave its waitpid lock held;
    the pool's kill path must still end (bounded) with the worker dead, not block forever in
    `p.wait()`."""
    import threading
    from pathlib import Path

    from harness.ranks.postmortem import REAP_TIMEOUT_S, kill_groups

    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)",
        ],
        start_new_session=True,
    )
    try:
        time.sleep(0.5)  # SIGTERM ignored: the kill path reaches SIGKILL
        assert p._waitpid_lock.acquire(False)  # what an interrupted Popen call leaves behind
        done = threading.Thread(target=kill_groups, args=([p],), daemon=True)
        done.start()
        done.join(timeout=2.0 + REAP_TIMEOUT_S + 10)
        assert not done.is_alive(), "kill_groups blocked on the held lock"
        stat = Path(f"/proc/{p.pid}/stat")
        # reaped, or dead and not yet reaped
        assert not stat.exists() or stat.read_text().split()[2] == "Z"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
