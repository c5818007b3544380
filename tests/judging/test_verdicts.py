"""The verdict rules (harness.judging.verdicts).

One verdict per case, in a fixed order: hang, then a failed rank outside the ring, then diverged,
then fail-stop. What a correct ring must end in under given faults, when a fault-stage case is
fine, which checks a failure failed, and what makes two failures the same bug.
"""

from __future__ import annotations

import pytest

from harness.case import make_case
from harness.faults.schema import make_fault, parse_fault
from harness.judging.judge import judge, needs_oracle
from harness.judging.verdicts import (
    case_expected,
    expected_verdict,
    failure_signature,
    fault_ok,
    killed_by,
)
from harness.ranks.protocol import PoolReply
from harness.result import CaseResult, LeakCheck, TensorCheck, Verdict


def _check(tensor: str, ok: bool) -> TensorCheck:
    return TensorCheck(
        tensor, 0, 0.5 if ok else 9.0, 1.0, 0, {"batch": 0, "token": 0, "head": 0}, ok
    )


def _judged(case, reply: PoolReply) -> CaseResult:
    """These replies stop before the tensor checks, so they are judged without the oracle."""
    assert not needs_oracle(case, reply)
    return judge(case, "x", reply, outputs=None)


# -- one verdict per case --------------------------------------------------------------------------


def test_the_verdict_is_hang_then_outside_the_ring_then_diverged_then_fail_stop():
    """Pass and silent-corruption need the oracle's outputs: every end-to-end test covers them."""
    c = make_case(world_size=2, total_len=4)
    raised = {"status": "error", "error": "RuntimeError: boom", "error_time": 1.0}
    shape = {"status": "diverged", "error": "ShapeError: output shape (1, 3) != expected (1, 4)"}
    hung = _judged(c, PoolReply(replies={0: shape}, hung={1: "stack"}))
    assert hung.verdict == Verdict.HANG and hung.hung == {1: "stack"}
    outside = _judged(c, PoolReply(replies={0: shape, 1: raised}, dead={2: "exit 1"}))
    assert outside.verdict == Verdict.FAIL_STOP
    assert outside.detail == "ranks outside the ring group failed: [2]"
    assert _judged(c, PoolReply(replies={0: shape, 1: raised})).verdict == Verdict.DIVERGED
    failed = _judged(c, PoolReply(replies={1: raised}, dead={0: "exit 1"}))
    assert failed.verdict == Verdict.FAIL_STOP
    assert failed.detail.startswith("rank 0 died (exit 1)")


def test_a_completed_ring_needs_the_oracle_and_judging_never_computes_it():
    """The caller passes the oracle's outputs (harness.runner.run_case): judging without them fails
    loudly."""
    c = make_case(world_size=1, total_len=4)
    reply = PoolReply(replies={0: {"status": "ok", "tensors": {}, "hashes": {}}})
    assert needs_oracle(c, reply)
    with pytest.raises(ValueError, match="needs the oracle's outputs"):
        judge(c, "x", reply, outputs=None)


# -- what the checks read from a verdict -----------------------------------------------------------


def test_expected_verdicts():
    spec = lambda *kinds: tuple(
        parse_fault(i, make_fault(k, rank=0), 2) for i, k in enumerate(kinds)
    )  # noqa: E731
    assert expected_verdict(spec("delay", "early-read", "send-reuse", "straggler")) == "pass"
    assert expected_verdict(spec("drop")) == expected_verdict(spec("delay", "crash")) == "fail-stop"
    assert (
        expected_verdict(spec("corrupt")) is None
        and expected_verdict(spec("delay", "corrupt")) is None
    )
    assert expected_verdict(()) is None


def test_a_fault_free_case_must_pass_and_a_faulted_one_ends_as_its_faults_say():
    c = make_case(world_size=2, total_len=4)
    assert case_expected(c) == Verdict.PASS
    assert case_expected(c.replace(faults=(make_fault("delay", rank=1),))) == Verdict.PASS
    assert case_expected(c.replace(faults=(make_fault("drop", rank=0),))) == Verdict.FAIL_STOP
    assert case_expected(c.replace(faults=(make_fault("corrupt", rank=0),))) is None


def test_a_fault_stage_case_is_fine_as_its_faults_require_or_when_it_tested_nothing():
    c = make_case(world_size=2, total_len=4)
    assert fault_ok(CaseResult(case=c, impl="x", verdict=Verdict.INVALID))
    as_expected, missed = {"as_expected": True}, {"as_expected": False}
    assert fault_ok(CaseResult(case=c, impl="x", verdict=Verdict.FAIL_STOP, extra=as_expected))
    assert not fault_ok(CaseResult(case=c, impl="x", verdict=Verdict.PASS))
    assert not fault_ok(CaseResult(case=c, impl="x", verdict=Verdict.DIVERGED, extra=missed))


def test_killed_by_names_each_failed_check():
    c = make_case(world_size=2, total_len=4, mask={"kind": "causal"})
    r = CaseResult(
        case=c,
        impl="x",
        verdict="silent-corruption",
        checks=[_check("out", True), _check("dk", False), _check("lse", False)],
        leak=LeakCheck(queries=[1], hidden_keys=[2], leaks=[{"tensor": "dk"}]),
    )
    assert killed_by(r) == ["lse", "dk", "leak check"]
    f = c.replace(faults=({"kind": "send-reuse"},))
    r = CaseResult(
        case=f, impl="x", verdict="silent-corruption", extra={"violations": ["rank 0: ..."]}
    )
    assert killed_by(r) == ["fault verdict (send-reuse)", "send-buffer check"]
    two = c.replace(faults=({"kind": "send-reuse"}, {"kind": "early-read"}))
    assert killed_by(CaseResult(case=two, impl="x", verdict="diverged"))[0] == (
        "fault verdict (early-read+send-reuse)"
    )
    assert killed_by(CaseResult(case=c, impl="x", verdict="fail-stop")) == ["fail-stop"]


def test_a_failure_signature_names_what_makes_two_failures_the_same_bug():
    c = make_case(world_size=2, total_len=4, mask={"kind": "causal"})
    wrong = CaseResult(
        case=c,
        impl="x",
        verdict=Verdict.SILENT_CORRUPTION,
        checks=[_check("out", True), _check("dk", False)],
        leak=LeakCheck(queries=[1], hidden_keys=[2], leaks=[{"tensor": "dk"}]),
    )
    # the cause, not the tensors: a leak is the forward's mask
    assert failure_signature(wrong) == ("silent-corruption", "forward")
    grads = CaseResult(
        case=c, impl="x", verdict=Verdict.SILENT_CORRUPTION, checks=[_check("dk", False)]
    )
    assert failure_signature(grads) == ("silent-corruption", "backward")
    both = CaseResult(
        case=c,
        impl="x",
        verdict=Verdict.SILENT_CORRUPTION,
        checks=[_check("out", False), _check("dk", False)],
    )
    assert failure_signature(both) == ("silent-corruption", "forward")
    # a fail-stop is its root cause's exception type, not the errors it caused on the other ranks
    errors = {0: "ConnectionError: peer closed", 1: "RuntimeError: boom"}
    root = {"root_cause": [1]}
    raised = CaseResult(case=c, impl="x", verdict=Verdict.FAIL_STOP, errors=errors, extra=root)
    assert failure_signature(raised) == ("fail-stop", "RuntimeError")
    crashed = c.replace(faults=(make_fault("crash", rank=0),))
    dead = {0: "killed by signal 9"}
    died = CaseResult(case=crashed, impl="x", verdict=Verdict.FAIL_STOP, dead=dead)
    assert failure_signature(died) == ("fail-stop", "died", "faults=crash")
