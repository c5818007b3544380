"""Process hygiene of the pool: which rank processes outlived the code that started them.

Runs in the parent. By default only the pids the caller recorded (`pool.pids()` after every case)
are looked at, plus whatever is left in their process groups (each worker leads its own session,
so anything it spawned is there too). Another pool of the same process, e.g. the pytest plugin's
session-scoped pool, is never counted. The /proc scan for every `harness.ranks.worker --parent
<pid>` is opt-in (`scan=True`): for a check from outside a process whose pool's pids are unknown.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from harness.ranks.zygote import zygote_pids

WORKER = "harness.ranks.worker"  # in every pool worker's command line


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running (not a zombie) and still a harness worker (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z" and WORKER in _cmdline(pid)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a process, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()
        return fields[0], int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def _of_parent(pid: int, parent: int) -> bool:
    """A live harness worker started by `parent` (its command line says so)."""
    return _alive(pid) and f"--parent {parent} " in _cmdline(pid) + " "


def _group_left(pgid: int, parent: int) -> set[int]:
    """Live processes still in worker `pgid`'s process group (what the worker spawned, or the
    worker). No /proc scan unless the group still exists. A pid reused by an unrelated process that
    leads its own group is not ours: the group is skipped (while our group has members its id cannot
    be reused)."""
    leader = _stat(pgid)
    if leader is not None and leader[0] != "Z" and not _of_parent(pgid, parent):
        return set()
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return set()
    except PermissionError:
        pass  # exists, owned by someone else: look
    out = set()
    for entry in os.listdir("/proc"):
        if (
            entry.isdigit()
            and (st := _stat(int(entry))) is not None
            and st[1] == pgid
            and st[0] != "Z"
        ):
            out.add(int(entry))
    return out


def leftover_workers(
    pids: Iterable[int],
    parent: int | None = None,
    wait_s: float = 10.0,
    scan: bool = False,
    groups: bool = True,
) -> list[str]:
    """Processes a run started that are still alive after it, waiting up to `wait_s` for them to go;
    one line "<pid>: <command line>" each, [] when none is left.

    Counted: each of `pids` that is still a harness worker of `parent` (default: this process), and
    with `groups` every live process in those workers' process groups. Nothing else: a pool that
    this process runs beside the one under test (the pytest plugin's session pool) does not count.

    `scan` (off by default) adds every `harness.ranks.worker --parent <parent>` found in /proc, for
    checking from outside after the process that owned the pool has exited (`pids` may then be
    empty). While `parent` is alive this also counts its other pools' workers."""
    parent = os.getpid() if parent is None else parent
    pids = set(pids)
    end = time.monotonic() + wait_s
    while True:
        left = {p for p in pids if _of_parent(p, parent)}
        if groups:
            for g in pids:
                left |= _group_left(g, parent)
        for entry in os.listdir("/proc") if scan else ():
            if entry.isdigit():
                cmd = _cmdline(int(entry))
                if WORKER in cmd and f"--parent {parent} " in cmd + " " and _alive(int(entry)):
                    left.add(int(entry))
        if parent == os.getpid():
            # this process's own zygotes: their command line is a worker's, they are not
            left -= zygote_pids()
        if not left or time.monotonic() > end:
            return [f"{p}: {_cmdline(p)[:120]}" for p in sorted(left)]
        time.sleep(0.2)
