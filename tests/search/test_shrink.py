"""Greedy shrinking keeps the failure's signature (its cause): a candidate that fails for another
cause is a different failure, recorded on its own and never the shrink target; signatures map to
distinct exception types."""

from __future__ import annotations

from harness.case import make_case
from harness.result import CaseResult, LeakCheck, TensorCheck
from harness.search.shrink import shrink
from harness.search.signature import CaseFailed, Signature, failure_type


def _result(c, bad: set[str]) -> CaseResult:
    checks = [
        TensorCheck(t, 0, 5.0 if t in bad else 0.5, 1.0, 0, {}, t not in bad)
        for t in ("out", "dq", "dk")
    ]
    leak = LeakCheck(
        queries=[0],
        hidden_keys=1,
        leaks=[{"rank": 0, "tensor": "dk", "token": 1, "count": 1}] if "leak" in bad else [],
    )
    return CaseResult(
        case=c,
        impl="planted",
        verdict="silent-corruption" if bad else "pass",
        checks=checks,
        leak=leak if c.mask.kind != "none" else None,
    )


def _two_bugs(c) -> CaseResult | None:
    """A causality leak on causal cases with W >= 2 (and a wrong dk); a crash on any case of at
    most 2 tokens, a smaller region that the leak's shrinking passes through."""
    if c.total_len <= 2:
        return CaseResult(case=c, impl="planted", verdict="fail-stop", errors={0: "ValueError: x"})
    bad = {"dk", "leak"} if c.mask.kind == "causal" and c.world_size >= 2 else set()
    r = _result(c, bad)
    return None if r.passed else r


def test_signature_of_a_result():
    c = make_case(world_size=2, total_len=8, mask={"kind": "causal"})
    sig = Signature.of(_result(c, {"dk", "leak"}))
    assert sig.impl == "planted" and sig.verdict == "silent-corruption" and sig.what == ("forward",)
    assert sig.label() == "silent-corruption: forward" and sig.slug() == "silent-corruption-forward"
    # one cause whatever the tensors; a gradient-only failure is another
    assert Signature.of(_result(c, {"out"})) == sig != Signature.of(_result(c, {"dq"}))


def test_each_signature_is_its_own_exception_type():
    c = make_case(world_size=2, total_len=8, mask={"kind": "causal"})
    a, b = Signature.of(_result(c, {"dk", "leak"})), Signature.of(_result(c, {"dq"}))
    assert failure_type(a) is failure_type(a) and failure_type(a) is not failure_type(b)
    assert issubclass(failure_type(a), CaseFailed) and failure_type(a).signature == a


def test_greedy_shrinking_keeps_the_signature_and_records_the_other_failure():
    first = _two_bugs(
        make_case(world_size=4, total_len=40, mask={"kind": "causal"}, heads_q=2, heads_kv=2)
    )
    others: dict = {}
    best, tried = shrink(first, _two_bugs, others=others)
    # still the leak (with dk), never the crash
    assert Signature.of(best) == Signature.of(first)
    assert (best.case.world_size, best.case.total_len, best.case.mask.kind) == (2, 3, "causal")
    # the 2-token candidate crashes: another signature, recorded (smallest) and not shrunk into
    assert list(others) == [Signature("planted", ("fail-stop", "ValueError"))]
    assert next(iter(others.values())).case.total_len == 2


def test_without_signatures_the_shrink_slips_to_the_other_failure():
    """The test above can fail: with one signature for every failure (the old rule), the leak is
    lost."""
    first = _two_bugs(
        make_case(world_size=4, total_len=40, mask={"kind": "causal"}, heads_q=2, heads_kv=2)
    )
    best, _ = shrink(first, _two_bugs, signature=lambda r: Signature(r.impl, ("failed",)))
    assert best.case.total_len <= 2 and best.verdict == "fail-stop"
