"""What the kernel says about memory: a process's RSS, the machine's free memory, the memory
cgroup's limit and OOM kills, and the kernel log's OOM-kill records.

Every reader returns None or an empty answer where its source is missing or unreadable. The watcher
and the words in harness.ranks.oom weigh what these say. Runs in the parent.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time


def proc_memory(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of a live process in bytes, or None when it is gone.

    A zombie has no Vm lines, so it counts as gone.
    """
    rss = hwm = None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None if rss is None else (rss, hwm or rss)


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable...). Empty where unreadable."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[name] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except (OSError, ValueError):
        pass
    return out


def _cgroup_dirs() -> list[str]:
    """This process's memory cgroup directories, v2 unified then v1 memory, where mounted."""
    dirs = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return dirs
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if ctrl == "":
            dirs += [
                f"/sys/fs/cgroup{path}".rstrip("/"),
                "/sys/fs/cgroup/unified" + path.rstrip("/"),
            ]
        elif "memory" in ctrl.split(","):
            dirs += [f"/sys/fs/cgroup/memory{path}".rstrip("/"), "/sys/fs/cgroup/memory"]
    return [d for d in dirs if os.path.isdir(d)]


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max") or not text.isdigit():
        return None
    return int(text)


def memory_limit() -> int:
    """Bytes this process tree may use: MemTotal, or the memory cgroup's limit where lower."""
    total = meminfo().get("MemTotal", 0) or 1 << 62
    for d in _cgroup_dirs():
        for name in ("memory.max", "memory.limit_in_bytes"):
            v = _read_int(os.path.join(d, name))
            if v:
                total = min(total, v)
    return total


def cgroup_oom_kills() -> int | None:
    """The memory cgroup's count of OOM kills, or None if unknown.

    It reads v2 memory.events, or v1 memory.oom_control.
    """
    for d in _cgroup_dirs():
        for name in ("memory.events", "memory.oom_control"):
            try:
                with open(os.path.join(d, name)) as f:
                    for line in f:
                        key, _, val = line.partition(" ")
                        if key == "oom_kill":
                            return int(val)
            except (OSError, ValueError):
                continue
    return None


_KMSG_TS = re.compile(r"^\d+,\d+,(\d+),[^;]*;(.*)$")
_DMESG_TS = re.compile(r"^\[\s*(\d+)\.(\d+)\]\s?(.*)$")


def kernel_log(max_bytes: int = 4 << 20) -> list[tuple[float, str]] | None:
    """(seconds since boot, message) of the kernel log's records. None when it cannot be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        fd = None
    if fd is not None:
        out, size = [], 0
        try:
            while size < max_bytes:
                try:
                    rec = os.read(fd, 16384)
                except BlockingIOError:
                    break
                except OSError as e:
                    # a record overwritten while reading: go on
                    if e.errno == errno.EPIPE:
                        continue
                    raise
                if not rec:
                    break
                size += len(rec)
                m = _KMSG_TS.match(rec.decode(errors="replace").split("\n", 1)[0])
                if m:
                    out.append((int(m.group(1)) / 1e6, m.group(2)))
            return out
        except OSError:
            pass
        finally:
            os.close(fd)
    try:
        text = subprocess.run(
            ["dmesg"], capture_output=True, timeout=2.0, check=True
        ).stdout.decode(errors="replace")
    except (OSError, subprocess.SubprocessError):
        return None
    out = []
    for line in text.splitlines():
        m = _DMESG_TS.match(line)
        if m:
            out.append((int(m.group(1)) + int(m.group(2)) / 10 ** len(m.group(2)), m.group(3)))
    return out


def oom_record(
    pid: int, records: list[tuple[float, str]] | None, since: float | None = None
) -> str | None:
    """The kernel's OOM-kill message naming `pid`, if any.

    Only messages logged at or after `since`, in seconds since boot, count.
    """
    for ts, msg in reversed(records or []):
        if since is not None and ts < since:
            break
        if ("Killed process" in msg and re.search(rf"Killed process {pid}\b", msg)) or (
            "oom-kill" in msg and re.search(rf"\bpid={pid}\b", msg)
        ):
            return msg.strip()
    return None


def boot_seconds() -> float:
    """Seconds since boot on the kernel log's clock (CLOCK_MONOTONIC)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)
