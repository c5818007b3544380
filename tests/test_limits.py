"""Every number's range, in one place (#51, harness.limits): the message gives the range."""

from __future__ import annotations

import argparse
import math

import pytest

from harness import limits
from harness.case import make_case
from harness.checks.options import CheckOptions, FaultBatteryOptions, SelftestOptions
from harness.commands import cli
from harness.errors import HarnessError


def test_a_range_takes_its_kind_and_its_ends():
    r = limits.Range(1, 64)
    assert r.holds(1) and r.holds(64) and not r.holds(0) and not r.holds(65)
    assert not r.holds(True) and not r.holds(2.0) and not r.holds("4") and not r.holds(None)
    f = limits.Range(0, 10, integer=False, open_lo=True, unit="seconds")
    assert f.holds(10) and f.holds(0.5) and not f.holds(0) and not f.holds(math.nan)
    assert f.words() == "a number of seconds in (0, 10]"
    assert limits.SEED.words() == "an integer in [0, 2**63 - 1]"


@pytest.mark.parametrize(
    "opts, flag, got",
    [
        (CheckOptions(world_size="4"), "--world-size", "'4'"),
        (CheckOptions(time_budget=math.nan), "--time-budget", "nan"),
        (CheckOptions(max_examples=10**30), "--max-examples", str(10**30)),
        (CheckOptions(fault_deadline=math.inf), "--fault-deadline", "inf"),
        (FaultBatteryOptions(seed=-1), "--fault-seed", "-1"),
        (SelftestOptions(false_alarm_cases=0), "--false-alarm-cases", "0"),
    ],
)
def test_an_option_out_of_range_names_the_flag_and_the_range(opts, flag, got):
    with pytest.raises(HarnessError) as e:
        opts.validate()
    r = limits.OPTIONS[flag]
    assert str(e.value) == f"{flag} must be {r.words()}, got {got}"


@pytest.mark.parametrize(
    "field, value",
    [
        ("head_dim", 100_000_000),
        ("batch", 0),
        ("group_offset", 10**6),
        ("seed", 2**63),
        ("deadline_s", 3601),
        ("softmax_scale", math.inf),
    ],
)
def test_a_case_field_out_of_range_names_the_field_and_the_range(field, value):
    with pytest.raises(HarnessError) as e:
        make_case(world_size=2, total_len=4, **{field: value})
    assert (
        str(e.value) == f"case field '{field}': must be {limits.CASE[field].words()}, got {value!r}"
    )


def test_a_group_offset_may_not_take_the_pool_past_its_limit():
    with pytest.raises(HarnessError, match=r"group_offset \+ world_size must be <= 64"):
        make_case(world_size=8, total_len=8, group_offset=60)


def test_every_option_in_the_table_is_a_flag_of_some_command():
    flags = {
        s
        for a in cli.build_parser()._actions
        if isinstance(a, argparse._SubParsersAction)
        for sp in a.choices.values()
        for act in sp._actions
        for s in act.option_strings
    }
    assert set(limits.OPTIONS) <= flags
