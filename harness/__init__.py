"""ring-harness: run ring attention on a pool of ranks and judge every rank against float64
attention.

The public Python API is re-exported here. The imports are lazy, so a rank process that imports
`harness.ranks.worker` does not load the checks.

    from harness import check, CheckOptions
    outcome = check(CheckOptions(impl="mypkg.attn:my_ring", max_examples=50))
    assert outcome.passed

- One call for your own tests: `assert_ring_close(impl, case=None)`.
- Checks: `check`, `replay`, `selftest`, `fault_battery`, each with its options dataclass.
  `Reporter` says where their lines go. `profile(*impls)`: does a ring keep its promises.
- Your own adapter: `Impl`, `Capabilities`, `RunContext`. Your own cases: `Case`, `make_case`.
- Results: `CaseResult`, `Verdict`. Errors: `HarnessError` for bad input, `RingHarnessError` the
  root.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "check": "harness.checks.check",
    "CheckOutcome": "harness.checks.outcome",
    "replay": "harness.checks.replay",
    "selftest": "harness.checks.selftest",
    "fault_battery": "harness.checks.fault_battery",
    "CheckOptions": "harness.checks.options",
    "ReplayOptions": "harness.checks.options",
    "SelftestOptions": "harness.checks.options",
    "FaultBatteryOptions": "harness.checks.options",
    "Reporter": "harness.checks.report",
    "Impl": "harness.context",
    "Capabilities": "harness.context",
    "RunContext": "harness.context",
    "Case": "harness.case",
    "make_case": "harness.case",
    "CaseResult": "harness.result",
    "Verdict": "harness.result",
    "HarnessError": "harness.errors",
    "RingHarnessError": "harness.errors",
    "run_case": "harness.runner",
    "assert_ring_close": "harness.checks.assertion",
    "profile": "harness.profiling.report",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
