"""Failure groups explained by experiment (issue #52), on judged runs made up by a rule: no ranks.

A rule stands in for a ring whose trigger is known. The tests pin the variants (one declared change
per feature), the words, the shrunk headline, the merge by trigger and the probes against their
declared base case. tests/checks/test_known_triggers.py runs the same on real rings.
"""

from __future__ import annotations

import time

from harness.case import make_case
from harness.checks import groups
from harness.checks.experiments import Lab, variants
from harness.checks.outcome import CheckOutcome, ProbeBase
from harness.checks.summary import outcome_json
from harness.context import Capabilities
from harness.result import CaseResult, TensorCheck, Verdict
from ring_impl.masks import MaskSpec

NARROW = Capabilities(
    layouts=frozenset({"contiguous"}),
    masks=frozenset({"none"}),
    dtypes=frozenset({"fp16", "bf16"}),
)


def _case(w=3, lens=None, **kw):
    return make_case(world_size=w, seq_lens=lens or (2,) * w, **kw)


def _judged(c, how: str) -> CaseResult:
    """A result as the judge would give it: 'pass', 'wrong' (out), 'grads' (dq alone) or 'crash'
    (RuntimeError)."""
    if how in ("wrong", "grads"):
        bad = TensorCheck("out" if how == "wrong" else "dq", 0, 1.0, 0.1, 0, {}, False)
        return CaseResult(c, c.impl, Verdict.SILENT_CORRUPTION, checks=[bad])
    if how == "crash":
        return CaseResult(c, c.impl, Verdict.FAIL_STOP, errors={0: "RuntimeError: boom"})
    return CaseResult(c, c.impl, Verdict.PASS)


def _lab(rule) -> Lab:
    return Lab(lambda c: _judged(c, rule(c)), Capabilities(), 8, until=time.monotonic() + 60)


def _battery(rule) -> list[CaseResult]:
    """What a battery of a few larger cases gave under `rule`."""
    cases = [
        _case(4, (4, 4, 4, 4)),
        _case(4, (5, 4, 4, 3), mask=MaskSpec("causal")),
        _case(3, (3, 3, 2), dtype="bf16"),
        _case(2, (4, 4)),
        _case(1, (6,)),
        _case(8, (2,) * 8, layout="zigzag"),
    ]
    return [_judged(c, rule(c)) for c in cases]


def test_one_declared_variant_per_feature_in_the_features_order():
    c = _case(3, (2, 2, 2))
    got = [(v.feature, v.words) for v in variants(c, Capabilities(), 8)]
    assert got[:6] == [
        ("world size", "W = 2"),
        ("uneven", "an uneven split"),
        ("mask", "mask causal"),
        ("layout", "zigzag"),
        ("layout", "striped"),
        ("dtype", "bf16"),
    ]
    words = dict(got)
    assert words["head_dim"] == "head_dim 56" and words["call"] == "call no-grad"
    # W = 2 keeps each rank's share; a W = 2 case goes up, one rank being no ring
    assert next(v for v in variants(c, Capabilities(), 8)).case.seq_lens == (2, 2)
    up = variants(_case(2, (3, 2)), Capabilities(), 8)[0]
    assert up.words == "W = 3" and up.case.seq_lens == (3, 2, 2)
    # only what is declared, and what fits the ranks started
    narrow = [(v.feature, v.words) for v in variants(_case(3, dtype="fp16"), NARROW, 8)]
    assert ("dtype", "bf16") in narrow and not {"layout", "mask"} & {f for f, _ in narrow}
    assert not any(v.feature == "world size" for v in variants(_case(2), Capabilities(), 2))


def test_a_w3_bug_is_named_by_w_alone_and_its_headline_is_shrunk():
    rule = lambda c: "wrong" if c.world_size >= 3 else "pass"  # noqa: E731
    res = CheckOutcome(impl="fake", results=_battery(rule))
    (g,) = res.groups = groups.build(res, _lab(rule))
    e = g.explanation
    assert e.trigger() == (("world size", "W = 2"),)
    assert e.line().startswith("passes at W = 2; still fails at an uneven split, mask causal")
    # shrunk here from the battery's smallest failing case, keeping its cause
    assert e.shrunk_from is not None and e.shrunk_from.stage == "battery"
    assert e.headline.case.world_size == 3 and e.headline.case.total_len == 3
    lines = groups.lines([g])
    assert lines[1] == f"  1. {e.line()}" and "statistics over every case run" in lines[2]
    assert any("shrunk from W3 contiguous none bf16" in x for x in lines)
    # every case behind the line is in the JSON, with its verdict and stage
    data = outcome_json(res)["failure_groups"][0]
    runs = data["experiments"]["experiments"]
    assert len(runs) == len(e.experiments) and all("spec" in r and r["stage"] for r in runs)
    assert {r["verdict"] for r in runs} == {"pass", "silent-corruption"}
    assert data["experiments"]["trigger"] == [{"feature": "world size", "changed_to": "W = 2"}]
    failing_runs = {r["key"] for r in runs if r["verdict"] != "pass"}
    assert failing_runs <= {c["key"] for c in data["cases"]}


def test_two_causes_with_one_trigger_are_one_group():
    """A crash on uneven splits and wrong numbers on even ones, both at W >= 3: each cause's
    experiments name W alone, so they are one group, whatever the error classes."""

    def rule(c):
        if c.world_size < 3:
            return "pass"
        return "crash" if len(set(c.seq_lens)) > 1 else "wrong"

    res = CheckOutcome(impl="fake", results=_battery(rule))
    (g,) = groups.build(res, _lab(rule))
    assert len(g.causes) == 2 and g.explanation.trigger() == (("world size", "W = 2"),)
    assert "an uneven split (as fail-stop)" in g.explanation.line()
    assert any(
        "causes (one bug: their smallest cases' experiments agree)" in x for x in groups.lines([g])
    )


def test_a_cause_that_values_hide_joins_the_group_it_fails_as_with_plain_values():
    """Wrong only in zigzag; near-tie values make out right within tolerance, so those cases fail
    in the gradients alone. With normal values that smallest case fails as the other group."""

    def rule(c):
        if c.layout != "zigzag":
            return "pass"
        return "grads" if c.values == "near-tie" else "wrong"

    results = _battery(rule) + [_judged(_case(2, layout="zigzag", values="near-tie"), "grads")]
    (g,) = groups.build(CheckOutcome(impl="fake", results=results), _lab(rule))
    assert g.explanation.line().startswith("passes at contiguous and striped; still fails at W")
    hidden = next(c for c, _ in g.causes if c.joins is not None)
    assert hidden.key == ("silent-corruption", "backward") and hidden.joins[0] == "normal values"
    assert any("at normal values its smallest case fails as" in x for x in groups.lines([g]))


def test_a_ring_wrong_everywhere_is_one_group_whatever_its_errors():
    """The issue's forward-only ring: one cause of every failure, in three error classes."""
    rule = lambda c: "crash" if c.dtype == "bf16" or c.world_size == 8 else "wrong"  # noqa: E731
    res = CheckOutcome(impl="fake", results=_battery(rule))
    (g,) = groups.build(res, _lab(rule))
    assert g.explanation.line().startswith("no one change makes it pass; still fails at W = 2")


def test_without_a_lab_groups_merge_by_their_statistics_as_before():
    rule = lambda c: "wrong" if c.world_size >= 3 else "pass"  # noqa: E731
    (g,) = groups.build(CheckOutcome(impl="fake", results=_battery(rule)))
    assert g.explanation is None and groups.lines([g])[1].startswith("  1. fails ")


def test_a_probe_is_a_finding_only_when_its_declared_base_passes():
    """A probe of an undeclared layout fails; so does its declared base at W = 4: no finding, and
    the group of the base names it. At W = 2 the base passes: a finding."""
    rule = lambda c: "wrong" if c.world_size >= 3 or c.layout == "striped" else "pass"  # noqa: E731
    res = CheckOutcome(impl="fake", results=_battery(rule))
    same = _judged(_case(4, (4, 4, 4, 4), layout="zigzag"), "wrong")
    own = _judged(_case(2, (4, 4), layout="striped"), "wrong")
    res.probe_results = [same, own]
    res.probe_bases = {
        same.case.key(): ProbeBase(("layout:zigzag",), res.results[0]),
        own.case.key(): ProbeBase(("layout:striped",), res.results[3]),
    }
    assert res.findings == [own]
    (g,) = res.groups = groups.build(res, _lab(rule))
    assert g.probes == ["layout:zigzag"] and res.probe_bases[same.case.key()].group == 1
    assert any(
        "1 probe of undeclared features fails as its declared case does: layout:zigzag" in x
        for x in groups.lines([g])
    )
    probes = outcome_json(res)["probes"]
    assert [p["finding"] for p in probes] == [False, True]
    assert probes[0]["base"]["group"] == 1 and probes[1]["base"]["verdict"] == "pass"
