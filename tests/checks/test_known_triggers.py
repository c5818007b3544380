"""Rings whose trigger is known: each check gives one group, named by that trigger alone (#52).

The rings are tests/helpers/known_triggers.py. Each check runs the battery and the property-based
run on one pool; its failure group's line must pass at exactly the trigger, and its JSON must hold
every case behind the line. The issue's own ring also shows probes that fail as their declared case
does: no findings. tests/checks/test_experiments.py pins the same rules without ranks.
"""

from __future__ import annotations

import pytest

from harness import CheckOptions
from harness.checks.check import run_check
from harness.checks.report import ListReporter
from harness.checks.summary import outcome_json

POOL_SIZE = 8  # ranks of the module's `pool` (tests/conftest.py): the battery's subgroups

# ring -> what its smallest case passes at, and nothing else does
TRIGGERS = {
    "past_two_ranks": "W = 2",
    "backward_only": "call no-grad",
    "fp16_only": "fp32 and bf16",
    "zigzag_only": "contiguous and striped",
    "dkv_wrong_neighbour": "W = 2 and at call no-grad",
}


def _check(pool, name: str, tmp_path):
    opts = CheckOptions(
        impl=f"tests.helpers.known_triggers:{name}",
        growth=False,
        scale=False,
        fault_stage=(),
        repeat=False,
        max_examples=50,  # each ring fails within its first ten examples
        save_dir=str(tmp_path),
    ).validate()
    return run_check(pool, opts, reporter=ListReporter())


# ~20-40 s each on 2 cores: a whole check of a ring with a real bug, the only run of the
# experiments against a trigger the test knows; the rules alone are test_experiments.py's.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_the_line_names_the_trigger_alone(pool, name, tmp_path):
    res = _check(pool, name, tmp_path)
    assert not res.passed and len(res.groups) == 1
    (g,) = res.groups
    e = g.explanation
    assert e.line().startswith(f"passes at {TRIGGERS[name]}; still fails at ")
    assert e.headline.stage in ("property", "shrinking")
    # every case behind the line is in the JSON: the headline, each variant, each member
    (data,) = outcome_json(res)["failure_groups"]
    runs = data["experiments"]["experiments"]
    assert [r["changed_to"] for r in runs] == [x.variant.words for x in e.experiments]
    assert all({"spec", "verdict", "stage", "case"} <= set(r) for r in runs)
    assert data["experiments"]["headline"]["key"] == e.headline.case.key()
    assert len(data["cases"]) == data["failing_runs"] == len(g.members)
    if name == "dkv_wrong_neighbour":
        # zigzag, striped and the masks fail as the contiguous unmasked case does: no finding
        assert not res.findings and {"layout:zigzag", "layout:striped"} <= set(g.probes)
        assert {p["base"]["group"] for p in outcome_json(res)["probes"] if p["base"]} == {1}
