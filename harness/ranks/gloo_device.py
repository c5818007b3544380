"""One gloo transport device for every gloo group of a pool rank.

torch gives each gloo process group a transport device of its own. Each device runs a loop thread
that wakes every 10 ms (gloo's epoll timeout), busy or not. A pool rank holds a group per ring
shape it has run: 6 to 18 of them, about 100 loop threads over 8 ranks. Their wakeups took ~10% of
the 2 cores during a default check (docs/benchmarks.md, section 15). gloo lets groups share a
device, so `share_one_device` makes every gloo group this process builds use one: one loop thread,
whatever the number of groups. Each group keeps its own pairs, timeout and work threads.

That loop thread runs under SCHED_BATCH (`batch_threads`). gloo's loop skips a pair's event while
another thread holds the pair's lock, and epoll hands the event back at once: the loop spins. On 2
cores shared by 8 ranks, the lock's holder is often waiting for a core, and a waking loop thread
preempted it. A default check made ~600,000 epoll_wait calls a second. A batch thread keeps its
share of the cores but does not preempt on waking, so the holder finishes first
(docs/benchmarks.md, section 16).
"""

from __future__ import annotations

import datetime
import os

_INSTALLED: dict = {}
# "batch": the loop threads run under SCHED_BATCH; "other": the scheduler's default, for
# side-by-side runs (scripts/gloo_loop_policy.py)
LOOP_POLICY_ENV = "RING_HARNESS_GLOO_LOOP"


def share_one_device() -> bool:
    """From now on, every gloo group of this process uses one transport device.

    The device is made here, in the process that uses it (a loop thread does not survive a fork).
    It is torch's default device: the interfaces in GLOO_SOCKET_IFNAME, else the host's. A group
    built with explicit options keeps them. Returns False where this torch lacks the API (private:
    `ProcessGroupGloo._Options`); its groups then keep a device each."""
    if _INSTALLED:
        return True
    before = _threads()
    try:
        from torch._C._distributed_c10d import ProcessGroupGloo as gloo

        options_cls = gloo._Options
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        devices = (
            [gloo.create_device(interface=n) for n in names]
            if names
            else [gloo.create_default_device()]
        )
    except (ImportError, AttributeError, RuntimeError):
        return False
    if os.environ.get(LOOP_POLICY_ENV, "batch") != "other":
        batch_threads(_threads() - before)  # the devices' loop threads: no other starts here
    init = gloo.__init__

    def __init__(self, store, rank, size, *args, **kwargs):
        given = args[0] if args else kwargs.get("options", kwargs.get("timeout"))
        if isinstance(given, options_cls):
            return init(self, store, rank, size, given)
        options = options_cls()
        options._devices = devices
        options._timeout = given if given is not None else datetime.timedelta(minutes=30)
        options._threads = 2 * len(devices)  # what torch gives a group of its own device(s)
        return init(self, store, rank, size, options)

    try:
        gloo.__init__ = __init__
    except (TypeError, AttributeError):  # a binding that refuses new attributes
        return False
    _INSTALLED.update(init=init, devices=devices)
    return True


def _threads() -> set[int]:
    """This process's thread ids (empty where /proc is missing)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except (OSError, ValueError):
        return set()


def batch_threads(tids: set[int]) -> int:
    """Put these threads under SCHED_BATCH; the number moved.

    The ids come from /proc, not the threads' names: gloo names its loop thread from inside it,
    maybe later. SCHED_BATCH needs no privilege. Where the call or the policy is missing, the
    threads keep the default policy."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return 0
    moved = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            moved += 1
        except OSError:  # the thread ended
            continue
    return moved
