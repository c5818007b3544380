"""The test suite's time budget, printed and enforced (loaded by tests/conftest.py).

At the end of a run the controller prints the wall time, the sum of every test's duration (setup,
call and teardown, as each worker reports it) and the 15 slowest tests. With `--time-budget SECONDS`
the run fails when that sum exceeds the budget; RING_HARNESS_TIME_BUDGET gives the same default, so
CI runs the README's test command as written. Why the sum and not wall or CPU time: docs/ci.md.
"""

from __future__ import annotations

import os
import time

import pytest

BUDGET_ENV = "RING_HARNESS_TIME_BUDGET"

SLOWEST = 15


def pytest_addoption(parser: pytest.Parser) -> None:
    env = os.environ.get(BUDGET_ENV)
    parser.addoption(
        "--time-budget",
        type=float,
        default=float(env) if env else None,
        metavar="SECONDS",
        help="fail the run when the sum of test durations (setup+call+teardown) "
        "exceeds SECONDS "
        f"(default: ${BUDGET_ENV})",
    )


class Budget:
    """Sums the durations the controller receives; one per process (xdist workers report to the
    controller)."""

    def __init__(self, limit: float | None) -> None:
        self.limit = limit
        self.start = time.monotonic()
        self.per_test: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.per_test[report.nodeid] = self.per_test.get(report.nodeid, 0.0) + report.duration

    @property
    def total(self) -> float:
        return sum(self.per_test.values())

    def over(self) -> bool:
        return self.limit is not None and self.total > self.limit

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.over() and exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        wall = time.monotonic() - self.start
        tr.section("time budget (tests/budget.py)")
        slowest = sorted(self.per_test.items(), key=lambda kv: -kv[1])[:SLOWEST]
        for nodeid, secs in slowest:
            tr.write_line(f"{secs:8.1f} s  {nodeid}")
        limit = "no budget given" if self.limit is None else f"budget {self.limit:.0f} s"
        tr.write_line(
            f"{len(self.per_test)} tests: sum of durations {self.total:.0f} s ({limit}); "
            f"wall {wall:.0f} s"
        )
        if self.over():
            tr.write_line(
                f"FAILED: the sum of test durations {self.total:.0f} s exceeds the "
                "budget "
                f"{self.limit:.0f} s (docs/ci.md says how to find the cost)",
                red=True,
                bold=True,
            )


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(
            Budget(config.getoption("--time-budget")), "ring-harness-time-budget"
        )
