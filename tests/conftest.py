"""Test-suite options and hygiene.

- Long fuzzing and fault batteries are marked `slow` and run only with --run-slow (or
  RING_HARNESS_SLOW=1); CI runs both tiers (.ci/run).
- Nothing is left behind: the controlling pytest process makes one short session directory
  (`rh-tests-*` in the system temp dir) and points at it every place a run writes: the rank pools'
  temp dirs (RING_HARNESS_TMPDIR), subprocesses' temp files such as torchrun's `torchelastic_*`
  dirs (TMPDIR, inherited by xdist workers and every subprocess), and hypothesis's storage
  (instead of `.hypothesis/` in the repository). It is removed when the session ends; what was
  still in it (a pool a test failed to close) is reported.
- One rank pool per test module: the `pool` fixture, sized by the module's `POOL_SIZE`.
- Test processes run torch with one thread: two xdist workers and their rank pools share the cores,
  and a process with more torch threads than free cores spin-waits at every parallel op
  (`harness.oracle.mode.oracle_threads`). Measured in the default suite before this: in-process
  oracle tests 25-50x slower than alone (test_correct_fp16_results_are_not_on_the_bf16_grid 1.15 s
  alone, 28.7 s there).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

SESSION_ENV = "RING_HARNESS_TEST_SESSION_DIR"
pytest_plugins = ["pytester", "tests.budget"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="also run tests marked slow"
    )


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)
    if _is_controller(config) and SESSION_ENV not in os.environ:
        # short: rank socket paths must fit in 107 bytes
        base = Path(tempfile.mkdtemp(prefix="rh-tests-"))
        for sub in ("pools", "tmp", "hypothesis"):
            (base / sub).mkdir()
        os.environ[SESSION_ENV] = str(base)
        os.environ["RING_HARNESS_TMPDIR"] = str(base / "pools")
        # subprocesses (torchrun, workers) make their temp files here
        os.environ["TMPDIR"] = str(base / "tmp")
        # subprocesses' hypothesis too
        os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = str(base / "hypothesis")
        # removed by a cleanup registered now, so it runs after the plugin's session pool
        # (registered later, cleaned up first) has closed
        config.add_cleanup(lambda: _remove_session_dir(base))
    base = Path(os.environ[SESSION_ENV])
    from hypothesis import configuration

    configuration.set_hypothesis_home_dir(str(base / "hypothesis"))


def _remove_session_dir(base: Path) -> None:
    left = (
        sorted(str(p.relative_to(base)) for p in (base / "pools").iterdir())
        if (base / "pools").exists()
        else []
    )
    if left:
        sys.stderr.write(
            f"ring-harness tests: {len(left)} pool temp dir(s) were not removed by "
            "their pools: "
            f"{', '.join(left[:5])}\n"
        )
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pool(request: pytest.FixtureRequest):
    """One rank pool for a test module, closed after the module's last test.

    The module gives its size once, at top level: `POOL_SIZE = 4`. The pool starts on its first
    case and grows on demand, as every `RankPool` does. Module scope is per xdist worker: each
    worker runs its own pool. A test that needs fresh ranks, or a pool of another kind (spare,
    a placement, another backend), opens its own `RankPool`. A module that checks more at the end
    overrides the fixture as `pool(pool)` and closes the pool itself first.
    """
    size = getattr(request.module, "POOL_SIZE", None)
    if not isinstance(size, int):
        pytest.fail(
            f"{request.module.__name__} asks for `pool`: give it `POOL_SIZE = N` at top level",
            pytrace=False,
        )
    # imported on first use: the harness loads torch, which a bare `pytest --help` never needs
    from harness.ranks.pool import RankPool

    with RankPool(size) as p:
        yield p


# skip reasons that mean "a library is not installed" (pytest.importorskip, the adapters' tests, the
# corpus)
MISSING_LIBRARY = re.compile(r"could not import|is not installed|needs the optional extra")
EXTRAS_ENV = "RING_HARNESS_EXTRAS_INSTALLED"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """A test that skips for a missing library must carry the `extra` marker, so that CI's extras
    step (`-m extra`, docs/ci.md) runs it; there, with RING_HARNESS_EXTRAS_INSTALLED=1, such a skip
    fails."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.skipped or not isinstance(rep.longrepr, tuple):
        return
    reason = str(rep.longrepr[2])
    if not MISSING_LIBRARY.search(reason):
        return
    if item.get_closest_marker("extra") is None:
        rep.outcome, rep.longrepr = (
            "failed",
            f"skipped for a missing library without the `extra` marker: {reason}",
        )
    elif os.environ.get(EXTRAS_ENV):
        rep.outcome, rep.longrepr = (
            "failed",
            f"{EXTRAS_ENV} is set but a library is missing: {reason}",
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow") or os.environ.get("RING_HARNESS_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or RING_HARNESS_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
