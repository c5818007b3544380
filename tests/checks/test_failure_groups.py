"""Failures grouped by cause, and the shared-feature line: one group per bug, its cause in words.

The unit tests pin the rules (harness.checks.groups, harness.checks.shared_features). One check of
a mutant wrong only at W = 3, 5, 6, 7 pins them end to end: the battery and the fault stage report
one group, the fault stage's failures join it, the saved file carries the line and --plot draws it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from harness import CheckOptions, check
from harness.case import make_case
from harness.checks.groups import HISTORY, RACY, FailureGroup, _merged, group_key
from harness.checks.report import ListReporter
from harness.checks.shared_features import explain
from harness.checks.summary import outcome_json
from harness.judging.run_record import RunRecord

WRONG = ("silent-corruption", "forward")


def _rec(cause=(), ranks=(), **kw) -> RunRecord:
    w = kw.pop("world_size", 2)
    c = make_case(world_size=w, total_len=kw.pop("total_len", 3 * w), **kw)
    return RunRecord(c, "battery", tuple(cause), frozenset(ranks))


def test_a_feature_that_separates_is_named_with_the_values_that_pass():
    failing = [_rec(WRONG, world_size=w) for w in (3, 5, 6, 7, 3)]
    passing = [_rec(world_size=w) for w in (1, 2, 4, 8, 4)]
    line = explain(failing, passing).line()
    assert line == (
        "fails exactly when W is 3, 5, 6 or 7 (passes at 1, 2, 4 and 8) (5 failing, 5 passing cases)"
    )


def test_an_ordered_feature_reads_as_a_threshold():
    failing = [_rec(WRONG, world_size=w, total_len=100 * w) for w in (1, 2, 3)]
    passing = [_rec(world_size=w, total_len=10 * w) for w in (1, 2, 3)]
    assert (
        explain(failing, passing)
        .line()
        .startswith("fails exactly when a rank holds more than 64 tokens (passes at 2-64)")
    )
    failing = [_rec(WRONG, world_size=w) for w in (3, 4, 8)]
    passing = [_rec(world_size=w) for w in (1, 2)]
    assert (
        explain(failing, passing).line().startswith("fails exactly when W >= 3 (passes at 1 and 2)")
    )


def test_two_conditions_and_an_honest_remainder():
    failing = [_rec(WRONG, world_size=w, mask={"kind": "causal"}) for w in (2, 3, 4)]
    passing = [_rec(world_size=w, mask={"kind": "none"}) for w in (2, 3)]
    passing += [_rec(world_size=1, mask={"kind": "causal"})]
    e = explain(failing, passing)
    assert e.exact and [c.feature.name for c in e.conditions] == ["mask", "world size"]
    # a passing case the conditions cannot tell apart: "only when", with the count
    passing.append(_rec(world_size=3, mask={"kind": "causal"}, seed=9))
    e = explain(failing, passing)
    assert not e.exact and e.also_passing == 1 and "1 passing case(s) meet that too" in e.line()


def test_it_says_so_when_nothing_separates_or_too_little_failed():
    same = [_rec(WRONG, seed=s) for s in range(4)]
    assert explain(same, [_rec(seed=9)]).line().startswith("no case feature separates")
    assert explain(same[:2], [_rec()]).line().startswith("too few failing cases")


def test_one_rank_wrong_is_said():
    failing = [_rec(WRONG, ranks={w - 1}, world_size=w) for w in (2, 3, 4)]
    assert explain(failing, [_rec(world_size=1)]).ranks == "only the last rank is wrong"
    failing[0] = _rec(WRONG, ranks={0, 1}, world_size=2)
    assert explain(failing, [_rec(world_size=1)]).ranks == ""


def test_a_faulted_failure_joins_the_fault_free_group_of_its_cause():
    faulted = (*WRONG, "faults=early-read")
    assert group_key(faulted, {WRONG}, set()) == WRONG
    # no fault-free case fails that way: a failure only under faults, its own group
    assert group_key(faulted, set(), set()) == faulted
    assert "only under faults: early-read" in FailureGroup(faulted).label()
    # a failure that did not reproduce on fresh ranks, or differs from itself: racy
    assert group_key(WRONG, {WRONG}, {WRONG}) == RACY
    assert group_key(("diverged", "repeat"), set(), set()) == RACY
    # one that a sequence of earlier cases reproduces: history-dependent, not racy
    assert group_key(WRONG, {WRONG}, set(), {WRONG}) == HISTORY


def test_a_bug_at_some_world_sizes_is_one_group_with_its_cause(tmp_path):
    """~15 s: the only end-to-end run of the grouping, the fault stage's fault-free re-run, the
    saved file's annotation and --plot on a battery failure."""
    rep = ListReporter()
    res = check(
        CheckOptions(
            impl="mutant:steps-rounded-to-power-of-two",
            max_examples=0,
            scale=False,
            growth=False,
            repeat=False,
            save_dir=str(tmp_path / "saved"),
            plot=str(tmp_path / "plots"),
        ),
        reporter=rep,
    )
    assert not res.passed and len(res.groups) == 1
    (g,) = res.groups
    assert g.key == WRONG and {"battery", "faults", "fault-free re-run"} <= {
        r.stage for r in g.members
    }
    assert all(r.case.world_size in (3, 5, 6, 7) for r in g.members)
    assert g.shared is not None and "W is 3" in g.shared.line()
    assert rep.lines[-1].endswith("1 failure group(s)")
    data = outcome_json(res)
    assert data["distinct_failures"] == 1
    assert data["failure_groups"][0]["shared_features"]["line"] == g.shared.line()
    # one file for the group, its `result:` carrying the cause and the line
    (saved,) = g.saved
    result = yaml.safe_load(Path(saved).read_text(encoding="utf-8"))["result"]
    assert result["shared_features"] == g.shared.line() and result["group"] == g.label()
    # --plot draws the battery's saved failure
    assert list((tmp_path / "plots").glob("*.png"))


def test_groups_whose_cases_share_the_same_features_are_one_bug_with_two_causes():
    """A crash on uneven splits and wrong numbers on even ones, both at W >= 3: one group, and a
    line per cause says what tells it from the other."""
    crash = ("fail-stop", "RuntimeError")
    uneven = [_rec(crash, world_size=w, total_len=3 * w + 1) for w in (3, 4, 5)]
    even = [_rec(WRONG, world_size=w) for w in (3, 4, 6)]
    passing = [_rec(world_size=w, total_len=n) for w in (1, 2) for n in (4, 5)]
    groups = [FailureGroup(crash, members=uneven), FailureGroup(WRONG, members=even)]
    for g in groups:
        g.shared = explain(g.members, passing)
    assert groups[0].shared.line().startswith("fails exactly when W >= 3")
    (one,) = _merged(groups, passing)
    assert len(one.members) == 6 and one.shared.exact
    (a, apart_a), (b, apart_b) = one.causes
    assert apart_a.condition_text() == "exactly when the split is uneven"
    assert apart_b.condition_text() == "exactly when it is even"
    assert one.label() == (
        "fail-stop: RuntimeError; silent-corruption: wrong out or lse (the gradients follow)"
    )
    # different conditions: two bugs, two groups
    other = FailureGroup(
        WRONG, members=[_rec(WRONG, world_size=1, dtype="bf16", seed=s) for s in range(3)]
    )
    other.shared = explain(other.members, passing)
    assert len(_merged([groups[0], other], passing)) == 2
