"""Workers forked from a zygote (harness.ranks.zygote): they run cases as spawned ones do, answer
like Popen (a death by signal is reported as one) and take their pool's environment. That they and
the zygote die with the owner: tests/ranks/test_pool.py::test_workers_die_with_their_parent."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from harness.case import make_case
from harness.ranks import zygote
from harness.ranks.leftovers import leftover_workers
from harness.ranks.pool import RankPool
from harness.runner import run_case

pytestmark = pytest.mark.skipif(
    not zygote.enabled(), reason="workers are spawned here (RING_HARNESS_FORK=0)"
)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_pool_forks_its_workers_from_one_zygote_that_outlives_the_pool():
    c = make_case(world_size=2, total_len=8, mask={"kind": "causal"}, layout="zigzag")
    with RankPool(2) as p:
        p.ensure(2)
        first = p.pids()
        parents = {_ppid(pid) for pid in first}
        assert parents <= zygote.zygote_pids() and len(parents) == 1  # one zygote forked both
        # each leads its own session, as a spawned one
        assert all(os.getpgid(pid) == pid for pid in first)
        assert run_case(c, p, "reference").passed
    assert leftover_workers(first, wait_s=5.0) == []
    with RankPool(2) as p:  # the next pool forks from the same zygote
        p.ensure(2)
        assert {_ppid(pid) for pid in p.pids()} == parents
        assert run_case(c, p, "reference").passed


def test_a_forked_worker_killed_by_a_signal_is_reported_as_popen_would():
    with RankPool(1) as p:
        p.ensure(1)
        proc = p.procs[0]
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
        assert "killed by signal 9 (SIGKILL)" in p._death(0)


def test_the_zygote_is_keyed_by_the_environment_the_workers_import_with(monkeypatch):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    z = zygote.zygote_for(env)
    # per pool, per test, or read at run time: one zygote serves them all (each child takes its
    # pool's env)
    assert (
        zygote.zygote_for(
            dict(
                env,
                RING_HARNESS_AUTHKEY="00",
                PYTEST_CURRENT_TEST="x",
                RING_HARNESS_TMPDIR="/tmp/elsewhere",
                RING_HARNESS_DEVICE="cpu",
            )
        )
        is z
    )
    other = zygote.zygote_for(
        dict(env, PYTHONPATH=os.pathsep.join([str(os.getcwd()), "/nonexistent-rh"]))
    )
    assert other is not z and other.alive() and z.alive()


def test_a_worker_takes_its_pools_environment_not_the_zygotes(tmp_path):
    """The auth key differs per pool: a worker that kept the zygote's (or the last pool's) could not
    be connected to. The log file is the pool's, appended."""
    for _ in range(2):
        with RankPool(1) as p:
            p.ensure(1)
            assert os.path.exists(os.path.join(p.dir, "log-0.txt"))


def test_fork_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(zygote.FORK_ENV, "0")
    with RankPool(1) as p:
        p.ensure(1)
        assert isinstance(p.procs[0], subprocess.Popen) and _ppid(p.pids()[0]) == os.getpid()


def test_a_zygote_that_cannot_start_leaves_the_pool_to_spawn_its_workers(monkeypatch):
    def broken(env):
        raise OSError("the worker zygote exited during its start (exit 1)")

    monkeypatch.setattr(zygote, "Zygote", broken)
    monkeypatch.setattr(zygote, "_ZYGOTES", {})
    monkeypatch.setattr(zygote, "_FAILED", [])
    with RankPool(1) as p:
        p.ensure(1)
        assert isinstance(p.procs[0], subprocess.Popen) and not zygote.enabled()
        assert run_case(make_case(world_size=1, total_len=4), p, "reference").passed


def test_a_prestarted_zygote_serves_the_pool_and_outlives_its_thread(monkeypatch):
    import time

    from harness.commands import cli

    monkeypatch.setattr(zygote, "_ZYGOTES", {})
    zygote.prestart()
    deadline = time.monotonic() + 60
    while not zygote.zygote_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    started = zygote.zygote_pids()
    assert len(started) == 1
    time.sleep(0.5)  # its PDEATHSIG follows the thread that started it, which lives on
    assert zygote.zygote_pids() == started
    with RankPool(2) as p:
        p.ensure(2)
        assert {_ppid(pid) for pid in p.pids()} == started
    zygote.close_all()
    # only the commands that start local CPU ranks prestart one
    calls = []
    monkeypatch.setattr(zygote, "prestart", lambda: calls.append(1))
    for argv in (["impls"], ["check", "--help"], ["check", "--launcher", "torchrun"], []):
        cli._prestart(argv)
    assert calls == []
    cli._prestart(["check", "--impl", "reference"])
    assert calls == [1]
