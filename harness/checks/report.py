"""Human-readable output: the injectable `Reporter` every check writes its lines to, one row per
case, a summary line, failure details, JSON results."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from harness import outputs
from harness.result import CaseResult

TENSOR_COLS = ("out", "lse", "dq", "dk", "dv")


def _ratio(x: float | None) -> str:
    if x is None:
        return "   -  "
    if x == float("inf"):  # a non-finite value came back (NaN or inf): no ratio to show
        return "nonfin"
    if x < 100:
        return f"{x:6.3f}"
    return f"{x:6.0f}" if x < 1e5 else f"{x:6.0e}"


def header() -> str:
    cols = " ".join(f"{t:>6}" for t in TENSOR_COLS)
    return f"{'#':>5}  {'case':<58} {cols}  {'leak':>4}  {'verdict':<17} {'secs':>6}"


def row(i: int, n: int, r: CaseResult) -> str:
    """One line: case summary, worst error ratio per tensor (error / allowed), leak, verdict."""
    cols = " ".join(_ratio(r.worst(t)) for t in TENSOR_COLS)
    leak = "-"
    if r.leak is not None:
        leak = "ok" if r.leak.passed else "LEAK"
    summary = r.case.summary()
    if len(summary) > 58:
        summary = summary[:55] + "..."
    return f"{i:>2}/{n:<2}  {summary:<58} {cols}  {leak:>4}  {r.verdict:<17} {r.timings.get('wall_s', 0):6.2f}"


def details(r: CaseResult) -> list[str]:
    """Indented lines explaining a non-pass verdict: where the errors are, which rank raised."""
    if r.passed:
        return []
    lines = [f"        -> {r.detail}"] if r.detail else []
    for c in sorted(r.failed_checks(), key=lambda c: -c.ratio)[:6]:
        p = c.position
        where = f"at batch {p.get('batch')}, global position {p.get('token')}, head {p.get('head')}"
        if c.tensor == "dsinks":  # one gradient per head, summed over the ranks
            lines.append(
                f"        dsinks (the ranks' sum): max err {c.error:.3g} > allowed {c.allowed:.3g} "
                f"(x{c.ratio:.3g}) at head {p.get('head')}"
                + (f"; {c.nonfinite} non-finite" if c.nonfinite else "")
            )
            continue
        if c.nonfinite:
            lines.append(
                f"        {c.tensor:>3} rank {c.rank}: {c.nonfinite} non-finite value(s) "
                f"({c.nonfinite_kinds or 'NaN/inf'}), first {where}"
            )
            continue
        if c.grid and c.error <= c.allowed:
            lines.append(
                f"        {c.tensor:>3} rank {c.rank}: precision lost: all "
                f"{c.grid_values} nonzero values are "
                f"exactly {c.grid} values (rounded through {c.grid}; max err "
                f"{c.error:.3g}, x{c.ratio:.3g} "
                "of allowed)"
            )
            continue
        lines.append(
            f"        {c.tensor:>3} rank {c.rank}: max err {c.error:.3g} > allowed "
            f"{c.allowed:.3g} "
            f"(x{c.ratio:.3g}) {where}" + (f"; all values are {c.grid} values" if c.grid else "")
        )
    for g, s in sorted(r.hung.items()):
        lines.append(f"        rank {g} stack:")
        lines.extend("          " + ln for ln in s.splitlines()[:12])
    return lines


def summary(results: Iterable[CaseResult], seconds: float) -> str:
    results = list(results)
    counts = Counter(r.verdict for r in results)
    parts = ", ".join(f"{counts[v]} {v}" for v in sorted(counts))
    return f"{len(results)} cases: {parts} in {seconds:.1f} s"


def write_json(path: str | os.PathLike, payload: dict, flag: str = "--json") -> Path:
    """Atomic JSON write; a path that fails gets a fallback file, printed (harness.outputs)."""
    return outputs.write(Path(path), json.dumps(payload, indent=1, default=str), flag)


class Reporter:
    """Where a check's human-readable lines go; call it with one line. Writes to `stream` (default:
    the current sys.stdout) and flushes, so progress shows when piped to a log. Checks take one as
    `reporter=` (selftest gives each mutant's check a log file's; tests a `ListReporter`)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout

    def __call__(self, line: str = "") -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class ListReporter(Reporter):
    """Keeps the lines (and writes nothing): for tests and for callers that print later."""

    def __init__(self) -> None:
        super().__init__(None)
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        self.lines.append(line)


out = Reporter()  # the default reporter: standard output
