"""One gloo transport device for all of a pool rank's groups (`harness.ranks.gloo_device`, #55)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness.case import make_case
from harness.runner import run_case

POOL_SIZE = 4

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc")


def _thread_ids(pid: int, name: str) -> list[int]:
    """The ids of a process's threads called `name`."""
    task = f"/proc/{pid}/task"
    out = []
    for t in os.listdir(task):
        try:
            with open(f"{task}/{t}/comm") as f:
                if f.read().strip() == name:
                    out.append(int(t))
        except OSError:  # the thread ended
            pass
    return out


def _threads(pid: int, name: str) -> int:
    return len(_thread_ids(pid, name))


@needs_proc
def test_every_group_of_a_pool_rank_shares_one_gloo_loop_thread(pool):
    """Six ring shapes make six groups on some ranks; each rank still runs one gloo loop thread,
    where torch alone gives a group one each (docs/benchmarks.md, section 15)."""
    for w, offset in ((2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (4, 0)):
        res = run_case(make_case(world_size=w, total_len=4 * w, group_offset=offset), pool)
        assert res.verdict.value == "pass", res.detail
    for proc in pool.procs:
        assert _threads(proc.pid, "gloo_tcp_loop") == 1
        assert _threads(proc.pid, "pt_gloo_runloop") >= 2 * 4  # each group's own work threads


def _policies(pid: int, name: str) -> list[int]:
    """The scheduling policies of a process's threads called `name`."""
    return [os.sched_getscheduler(t) for t in _thread_ids(pid, name)]


@needs_proc
@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="no SCHED_BATCH here")
def test_the_gloo_loop_thread_runs_as_a_batch_thread(pool):
    """The loop thread spins while a busy rank holds a pair's lock; as a batch thread it no longer
    preempts the holder (docs/benchmarks.md, section 16). The rank's other threads keep the
    default policy."""
    res = run_case(make_case(world_size=POOL_SIZE, total_len=4 * POOL_SIZE), pool)
    assert res.verdict.value == "pass", res.detail
    for proc in pool.procs:
        assert _policies(proc.pid, "gloo_tcp_loop") == [os.SCHED_BATCH]
        assert set(_policies(proc.pid, "pt_gloo_runloop")) == {os.SCHED_OTHER}
        assert os.sched_getscheduler(proc.pid) == os.SCHED_OTHER


@needs_proc
def test_a_group_on_the_shared_device_keeps_its_timeout(tmp_path):
    """A group built after `share_one_device` has its own timeout and two work threads, on the one
    device; a group built with explicit options keeps them."""
    code = textwrap.dedent(
        f"""
        import datetime, os, torch, torch.distributed as dist
        from torch._C._distributed_c10d import ProcessGroupGloo
        from harness.ranks import gloo_device
        assert gloo_device.share_one_device()
        dist.init_process_group(
            "gloo", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1
        )
        groups = [dist.new_group([0], timeout=datetime.timedelta(seconds=s)) for s in (7, 9)]
        for g, s in zip(groups, (7, 9)):
            b = g._get_backend(torch.device("cpu"))
            assert b.options._timeout == datetime.timedelta(seconds=s), b.options._timeout
            assert len(b.options._devices) == 1 and b.options._threads == 2
        own = ProcessGroupGloo._Options()
        own._devices = [ProcessGroupGloo.create_default_device()]
        own._timeout = datetime.timedelta(seconds=3)
        b = ProcessGroupGloo(dist.FileStore({str(tmp_path / "store2")!r}, 1), 0, 1, own)
        assert b.options._timeout == datetime.timedelta(seconds=3)
        t = torch.ones(3)
        dist.all_reduce(t, group=groups[1])
        names = [open(f"/proc/self/task/{{t}}/comm").read().strip()
                 for t in os.listdir("/proc/self/task")]
        print(names.count("gloo_tcp_loop"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # the shared device's loop and the explicitly given device's
    assert out.stdout.split()[-1] == "2"
