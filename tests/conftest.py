"""Test-suite options: long fuzzing and fault batteries are marked `slow` and run only with
--run-slow (or RING_HARNESS_SLOW=1), keeping the default suite within CI's budget."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow") or os.environ.get("RING_HARNESS_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or RING_HARNESS_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
