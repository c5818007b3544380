"""Shared helpers for the benchmarks: figures with targets, interleaved repeats, medians, CPU time.

Every target is a ratio of two measurements taken side by side in one run (A and B interleaved,
repeated, medians reported), so other work on the machine slows both sides alike.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Target:
    """One measured value against its bound; op is one of <, <=, >=."""

    label: str
    value: float
    op: str
    bound: float
    unit: str = ""

    @property
    def met(self) -> bool:
        return {
            "<": self.value < self.bound,
            "<=": self.value <= self.bound,
            ">=": self.value >= self.bound,
        }[self.op]

    def line(self) -> str:
        """e.g. 'pool / spawn per-case overhead = 0.012  target <= 0.05  MET'."""
        return (
            f"{self.label} = {fmt(self.value)}{self.unit}   target {self.op} "
            f"{fmt(self.bound)}{self.unit}   "
            f"{'MET' if self.met else 'MISSED'}"
        )

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "value": self.value,
            "op": self.op,
            "bound": self.bound,
            "unit": self.unit,
            "met": self.met,
        }


@dataclass
class Figure:
    """One benchmark's result: a title, detail lines, its targets and raw data for --json."""

    name: str
    title: str
    lines: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    seconds: float = 0.0

    def render(self) -> list[str]:
        out = [f"[{self.name}] {self.title}"]
        out += [f"    {ln}" for ln in self.lines]
        out += [f"  > {t.line()}" for t in self.targets]
        return out

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "title": self.title,
            "lines": self.lines,
            "targets": [t.to_dict() for t in self.targets],
            "data": self.data,
            "seconds": self.seconds,
        }


def fmt(x: float) -> str:
    """Compact number: 3 significant digits, no exponent for ordinary magnitudes."""
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def interleaved(fns: dict[str, Callable[[], float | None]], reps: int) -> dict[str, list[float]]:
    """Call each function once per round, `reps` rounds, in rotating order; each returns the seconds
    it measured itself (or None: its own wall time is used)."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        order = names[i % len(names) :] + names[: i % len(names)]
        for n in order:
            t0 = time.perf_counter()
            got = fns[n]()
            times[n].append(time.perf_counter() - t0 if got is None else float(got))
    return times


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    """User + system CPU seconds of this process."""
    t = os.times()
    return t.user + t.system


def load_line() -> str:
    """The machine's load averages and core count, printed with timings measured on a shared
    host."""
    one, five, _ = os.getloadavg()
    return f"host: {os.cpu_count()} cores, load average {one:.1f} (1 min) / {five:.1f} (5 min)"


def in_fresh_process(
    module: str,
    args: list[str],
    what: str,
    timeout_s: float = 1800.0,
    env: dict[str, str] | None = None,
) -> dict:
    """Run `python -m module *args --parent PID` in a fresh process of its own session (one torch
    thread, this checkout first on PYTHONPATH, `env` added; killed as a group past `timeout_s`) and
    return the JSON object it prints last: a figure measured with its own baseline and high-water
    mark."""
    root = str(Path(__file__).resolve().parents[2])
    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [root, full.get("PYTHONPATH")]))
    p = subprocess.Popen(
        [sys.executable, "-m", module, *args, "--parent", str(os.getpid())],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout_s)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if p.returncode:
        raise RuntimeError(f"{what} failed: {err.decode(errors='replace')[-600:]}")
    return json.loads(out.decode().strip().splitlines()[-1])
