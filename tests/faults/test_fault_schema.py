"""Fault specs in Case YAML: defaults, canonical form, exact round trip, one clear error per bad
field."""

from __future__ import annotations

import pytest

from harness import case as case_mod
from harness.case import make_case
from harness.errors import HarnessError
from harness.faults.schema import KINDS, make_fault, parse_fault, parse_faults, to_dict

BASE = "world_size: 3\nseq_lens: [4, 4, 4]\n"


def test_one_shot_kinds_default_to_the_first_matching_op():
    drop = parse_fault(0, {"kind": "drop", "rank": 1}, 3)
    assert (drop.op, drop.index, drop.phase) == ("send", 0, "any")
    delay = parse_fault(0, {"kind": "delay"}, 3)
    assert (delay.rank, delay.index, delay.op) == (None, None, "any")  # every op on every rank


@pytest.mark.parametrize("kind", KINDS)
def test_canonical_form_parses_back_to_the_same_spec(kind):
    d = make_fault(kind, rank=1)
    assert make_fault(**d) == d
    assert parse_fault(0, d, 2) == parse_fault(0, {"kind": kind, "rank": 1}, 2)


def test_faulted_case_round_trips_through_yaml(tmp_path):
    faults = (
        make_fault("delay", rank=None, seconds=0.01, jitter=0.02, where="complete"),
        make_fault("corrupt", rank=2, phase="backward", op="recv", index=1, bit=30, count=2),
        make_fault("crash", rank=0, index=3, how="exit1"),
    )
    c = make_case(world_size=3, total_len=12, faults=faults, deadline_s=9.0)
    loaded, _ = case_mod.load(case_mod.save(c, tmp_path / "f.yaml"))
    assert loaded == c
    assert parse_faults(loaded.faults, 3) == parse_faults(faults, 3)


def test_yaml_fault_list_is_readable():
    c, _ = case_mod.loads(
        BASE + "faults:\n  - {kind: drop, rank: 1, phase: forward, index: 0}\n"
        "  - {kind: straggler, rank: 2, factor: 3}\n"
    )
    specs = parse_faults(c.faults, 3)
    assert [s.describe() for s in specs] == [
        "drop rank 1 forward send #0",
        "straggler rank 2 x3 compute",
    ]
    assert to_dict(specs[1]) == {
        "kind": "straggler",
        "rank": 2,
        "phase": "any",
        "factor": 3.0,
        "slow": "compute",
    }


@pytest.mark.parametrize(
    "faults, field, needle",
    [
        ("[{kind: melt}]", "faults[0].kind", "unknown fault kind 'melt'"),
        ("[{kind: drop}]", "faults[0].rank", "needs the group rank"),
        ("[{kind: drop, rank: 3}]", "faults[0].rank", "0..2"),
        ("[{kind: drop, rank: true}]", "faults[0].rank", "0..2"),
        (
            "[{kind: drop, rank: 0, op: recv}]",
            "faults[0].op",
            "applies to send/collective ops or a collective family (all_gather, all_to_all",
        ),
        ("[{kind: send-reuse, op: recv}]", "faults[0].op", "applies to send/any/collective ops"),
        ("[{kind: drop, rank: 0, index: null}]", "faults[0].index", "happens once"),
        ("[{kind: delay}, {kind: delay, index: -2}]", "faults[1].index", "op number >= 0"),
        ("[{kind: delay, secs: 1}]", "faults[0].secs", "not a field of a delay fault"),
        ("[{kind: delay, seconds: -1}]", "faults[0].seconds", "number of seconds"),
        ("[{kind: delay, where: later}]", "faults[0].where", "post, complete"),
        ("[{kind: delay, phase: sideways}]", "faults[0].phase", "any, forward, backward"),
        ("[{kind: corrupt, rank: 0, bit: 99}]", "faults[0].bit", "0..63"),
        ("[{kind: straggler, rank: 0, factor: 0.5}]", "faults[0].factor", "slowdown factor"),
        ("[{kind: straggler, rank: 0, index: 2}]", "faults[0].index", "no index"),
        (
            "[{kind: straggler, rank: 0}, {kind: straggler, rank: 0}]",
            "faults[1].rank",
            "one straggler per rank",
        ),
        ("[{kind: crash, rank: 0, how: explode}]", "faults[0].how", "exit0, exit1, sigkill"),
        ("[5]", "faults[0]", "must be a mapping"),
        ("{kind: drop}", "faults", "must be a list"),
    ],
)
def test_malformed_fault_is_one_line_naming_the_field(faults, field, needle):
    with pytest.raises(HarnessError) as e:
        case_mod.loads(BASE + f"faults: {faults}\n", "bad.yaml")
    msg = str(e.value)
    assert f"'{field}'" in msg and needle in msg
    assert msg.startswith("bad.yaml: case field") and "\n" not in msg
