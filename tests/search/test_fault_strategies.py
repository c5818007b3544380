"""The hypothesis strategy for fault lists: always valid, fatal faults alone, none for a single
rank."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.faults.schema import FATAL, KINDS, parse_faults
from harness.search.fault_strategies import fault, faults


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 6).flatmap(lambda w: st.tuples(st.just(w), faults(w, max_faults=3))))
def test_drawn_fault_lists_are_valid_and_fatal_faults_come_alone(drawn):
    w, fl = drawn
    specs = parse_faults(fl, w)
    assert len(specs) <= 3
    if any(s.kind in FATAL for s in specs):
        assert len(specs) == 1
    for s in specs:
        assert s.index is None or s.index <= w - 2  # fires on any ring of w ranks


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(KINDS).flatmap(lambda k: st.tuples(st.just(k), fault(k, 3))))
def test_each_kind_draws_its_own_kind(drawn):
    kind, f = drawn
    assert f["kind"] == kind and parse_faults((f,), 3)[0].kind == kind


@given(faults(1))
def test_no_faults_for_a_single_rank(fl):
    assert fl == ()
