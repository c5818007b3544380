"""Progress of a long property-based run: a rich progress bar on a terminal (examples done,
failures, elapsed, rate), plain log lines when the output is not a terminal (CI logs, pipes)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

PLAIN_EVERY_S = 10.0


def _rate(runs: int, seconds: float) -> float:
    return runs / seconds if seconds > 0 else 0.0


class FuzzProgress:
    """Callable as fuzz's `progress(outcome, phase)`; use as a context manager."""

    def __init__(
        self,
        max_examples: int,
        budget_s: float,
        *,
        stream: TextIO | None = None,
        plain: bool | None = None,
        every_s: float = PLAIN_EVERY_S,
    ) -> None:
        self.max_examples = max_examples
        self.budget_s = budget_s
        self.stream = stream or sys.stdout
        self.every_s = every_s
        self.plain = plain if plain is not None else not self.stream.isatty()
        self._bar = None
        self._task = None
        self._last_line = 0.0
        self._last_state: tuple = ()
        if not self.plain:
            try:
                self._start_rich()
            except ImportError:  # rich is an optional extra
                self.plain = True

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("examples"),
            TextColumn("[red]{task.fields[failures]} failing"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[rate]:.1f} cases/s"),
            console=Console(file=self.stream),
            transient=False,
        )
        self._task = self._bar.add_task(
            "property-based", total=self.max_examples, failures=0, rate=0.0
        )

    def __enter__(self) -> FuzzProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def line(self, out, phase: str) -> str:
        """The plain-text progress line."""
        fails = f", {out.failures} failing" if out.failures else ", no failure"
        return (
            f"property-based [{phase}]: {out.examples}/{self.max_examples} examples{fails}, "
            f"{out.runs} runs in {out.seconds:.1f} s ({_rate(out.runs, out.seconds):.1f} "
            "cases/s, "
            + (
                f"budget {self.budget_s:g} s)"
                if self.budget_s != float("inf")
                else "no time budget)"
            )
        )

    def __call__(self, out, phase: str) -> None:
        if self._bar is not None:
            desc = "searching" if phase == "search" else "shrinking"
            self._bar.update(
                self._task,
                completed=out.examples,
                failures=out.failures,
                rate=_rate(out.runs, out.seconds),
                description=desc,
            )
            return
        now = time.monotonic()
        state = (phase, out.failures > 0)
        if state != self._last_state or now - self._last_line >= self.every_s:
            self.stream.write(self.line(out, phase) + "\n")
            self.stream.flush()
            self._last_line, self._last_state = now, state
