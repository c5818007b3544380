"""The suite's time budget (tests/budget.py): the sum of test durations is printed with the slowest
tests, and a run whose sum passes --time-budget fails even when every test passed."""

from __future__ import annotations

import pytest

SLEEPY = """
import time

def test_a():
    time.sleep(0.2)

def test_b():
    time.sleep(0.1)
"""


def test_over_budget_fails_the_run_and_names_the_slowest(pytester: pytest.Pytester):
    pytester.makepyfile(SLEEPY)
    res = pytester.runpytest_inprocess("-p", "tests.budget", "--time-budget", "0.15")
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.assert_outcomes(passed=2)
    out = res.stdout.str()
    assert out.index("test_a") < out.index("test_b")  # slowest first
    assert "FAILED: the sum of test durations" in out


def test_within_budget_passes_and_prints_the_sum(pytester: pytest.Pytester):
    pytester.makepyfile(SLEEPY)
    res = pytester.runpytest_inprocess("-p", "tests.budget", "--time-budget", "30")
    assert res.ret == pytest.ExitCode.OK
    assert "2 tests: sum of durations" in res.stdout.str() and "budget 30 s" in res.stdout.str()
    assert "FAILED: the sum" not in res.stdout.str()
