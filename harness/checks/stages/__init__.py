"""The stages of the default check, one module each, behind one small interface (`Stage`).

`harness.checks.check.Check` runs them in order: growth, battery (with the probes and the
capability matrix), scale, faults, property. `--shape` runs the shape stage alone. Each module
is a `Stage`: its `name`, the ranks it asks for, and `run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from harness.checks.check import Check
    from harness.checks.options import CheckOptions
    from harness.context import Capabilities


class Stage(Protocol):
    """One stage of the default check. A stage module has these three names at module level."""

    # Its name in `Failure.stage` and in `CheckOutcome.stage_seconds`.
    name: str

    def ranks(self, opts: CheckOptions, caps: Capabilities) -> int:
        """The ranks it asks the pool to start, before the pool exists. 0: it fits any pool."""
        ...

    def run(self, check: Check) -> bool:
        """Run its cases into `check.outcome`; record failures on `check`. True: stop the check."""
        ...
