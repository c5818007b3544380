"""The rules that read a verdict, and the rules that adjust one under faults.

`harness.judging.judge` gives each case one `Verdict`. `apply_faults` then accounts for a faulted
case's faults. The checks read verdicts through `fault_ok`, `PROBE_OUTCOMES` and `killed_by`.
`failure_signature` says when two failures are the same bug.

The caller runs the fault-free baseline (`harness.runner.baseline_for`) and passes it in.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from harness.case import Case
from harness.faults.pg_guard import REFUSED as GROUP_REFUSED
from harness.faults.schema import BENIGN, FATAL, FaultSpec, parse_faults
from harness.result import TENSORS, CaseResult, Verdict

FORWARD = ("out", "lse")  # the tensors the forward returns

DEATH_OF = {"exit0": "exit 0", "exit1": "exit 1", "sigkill": "killed by signal 9"}

PROBE_OUTCOMES = {
    Verdict.FAIL_STOP: "rejected with an error (right)",
    Verdict.PASS: "works although undeclared",
    Verdict.SILENT_CORRUPTION: "FINDING: accepted and returned wrong numbers",
    Verdict.DIVERGED: "FINDING: accepted and returned wrong shapes",
    Verdict.HANG: "FINDING: hangs",
}


def expected_verdict(specs: tuple[FaultSpec, ...]) -> Verdict | None:
    """What a correct implementation must end in under these faults.

    Under drop or crash it is fail-stop, and under benign faults pass. None means anything goes: a
    corrupt fault is involved.
    """
    kinds = {s.kind for s in specs}
    if kinds & FATAL:
        return Verdict.FAIL_STOP
    if kinds and kinds <= BENIGN:
        return Verdict.PASS
    return None


def case_expected(case: Case) -> Verdict | None:
    """`expected_verdict` of a case's faults, and pass for a fault-free case."""
    return (
        expected_verdict(parse_faults(case.faults, case.world_size))
        if case.faults
        else Verdict.PASS
    )


def probe_acceptable(r: CaseResult) -> bool:
    """Whether a probe of an undeclared feature worked, or was refused with an error."""
    return r.verdict in (Verdict.PASS, Verdict.FAIL_STOP)


def fault_ok(r: CaseResult) -> bool:
    """Whether a fault-stage case ended the way its faults require, or tested nothing.

    Under benign faults the case must pass, bit-identical. An `invalid` case tested nothing: the
    implementation makes no op the fault applies to, e.g. send-reuse on an all-gather ring. That is
    reported as not applicable, not as the implementation's failure.
    """
    return r.verdict == Verdict.INVALID or bool(r.extra.get("as_expected", False))


def killed_by(r: CaseResult) -> list[str]:
    """Which checks a failing result failed.

    They are the tensors, the leak check, the send-buffer check, the fault verdict and the verdict.
    """
    out = []
    if r.case.faults:
        out.append(f"fault verdict ({'+'.join(sorted({f['kind'] for f in r.case.faults}))})")
    bad = {c.tensor for c in r.failed_checks()}
    out += [t for t in TENSORS if t in bad]
    grids = sorted({f"{c.tensor} on the {c.grid} grid" for c in r.failed_checks() if c.grid})
    if grids:
        out.append(f"precision ({', '.join(grids)})")
    if r.leak is not None and not r.leak.passed:
        out.append("leak check")
    if r.extra.get("violations"):
        out.append("send-buffer check")
    if r.extra.get("repeat", {}).get("identical") is False:
        out.append("repeat")
    if r.verdict in (Verdict.FAIL_STOP, Verdict.HANG, Verdict.DIVERGED, Verdict.INVALID):
        out.append(str(r.verdict))
    return out


def failure_signature(r: CaseResult) -> tuple[str, ...]:
    """What makes two failures the same bug: its cause, not the tensors it happened to break.

    The check groups failures by it: one group, one saved file each. The shrinker keeps it. The
    signature is the verdict, then:
    - wrong numbers: "forward" when out, lse or the leak check fail (the backward then reads them
      too), else "backward"; "precision" when only the precision grid fails; "send-buffer" when a
      send buffer was overwritten;
    - a fail-stop or diverged run: the root cause's exception type;
    - a run that differs from itself: "repeat";
    - a faulted case: the fault kinds.
    `killed_by` names the failing tensors. docs/check.md ("Failure groups") gives the rule.
    """
    sig: list[str] = [str(r.verdict)]
    if r.verdict == Verdict.SILENT_CORRUPTION:
        sig.append(_wrong_part(r))
    elif r.extra.get("repeat", {}).get("identical") is False:
        sig.append("repeat")
    elif r.verdict in (Verdict.FAIL_STOP, Verdict.DIVERGED):
        roots = r.extra.get("root_cause") or sorted(r.errors)
        errors = [r.errors[g].split(":", 1)[0] for g in roots if g in r.errors]
        sig += errors[:1] or (["died"] if r.dead else [])
    if r.case.faults:
        sig.append("faults=" + "+".join(sorted({f["kind"] for f in r.case.faults})))
    return tuple(sig)


def _wrong_part(r: CaseResult) -> str:
    """Which part of the ring a wrong result points at: forward, backward, precision, send-buffer."""
    if r.extra.get("violations"):
        return "send-buffer"
    failed = r.failed_checks()
    if failed and all(c.grid for c in failed) and (r.leak is None or r.leak.passed):
        return "precision"
    if (r.leak is not None and not r.leak.passed) or any(c.tensor in FORWARD for c in failed):
        return "forward"
    return "backward"


def adapter_error(r: CaseResult) -> str | None:
    """One line when a run failed in the implementation's adapter rather than in its ring.

    That is when every ring rank raised before any communication op, or every rank returned an
    output or gradient of the wrong shape or type, or a rank made a process group inside run (the
    interposer refuses it: the pool's other ranks would never join). Otherwise it is None. A ring that raises, dies or
    hangs mid-ring is a fail-stop or a hang: a finding.
    """
    w = r.case.world_size
    refused = next((e for _, e in sorted(r.errors.items()) if GROUP_REFUSED in e), None)
    if refused is not None:  # a process group made inside run (harness.faults.pg_guard)
        where = next((x for _, x in sorted(r.extra.get("where", {}).items()) if x), "")
        return refused.rsplit(" (at ", 1)[0] + (f" [your code: {where}]" if where else "")
    if r.dead or r.hung or len(r.errors) < w:
        return None
    comm = r.extra.get("comm", {})
    if r.verdict == Verdict.DIVERGED and all(
        r.errors[g].startswith("ShapeError") for g in range(w)
    ):
        return f"run(q, k, v, ctx) returned a wrong result on every rank: {r.errors[0].split(' (at ')[0]}"
    if r.verdict == Verdict.FAIL_STOP and all(not comm.get(g) for g in range(w)):
        where = r.extra.get("where", {}).get(0, "")
        return f"run(q, k, v, ctx) raised on every rank before any communication: {r.errors[0]}" + (
            f" [your code: {where}]" if where and where not in r.errors[0] else ""
        )
    return None


# -- faults ----------------------------------------------------------------------------------------


def fired_counts(res: CaseResult, notes: dict[int, dict]) -> Counter[int]:
    """Fault id -> times fired over every rank.

    It counts the survivors' reports and the dead ranks' crash notes.
    """
    total: Counter[int] = Counter()
    for rep in res.extra.get("faults", {}).values():
        for fid, n in rep.get("fired", {}).items():
            total[int(fid)] += int(n)
    for note in notes.values():
        for fid, n in note.get("fired", {}).items():
            total[int(fid)] += int(n)
    return total


def _crash_checks(
    specs: tuple[FaultSpec, ...], res: CaseResult, notes: dict[int, dict]
) -> list[str]:
    """Crash faults whose rank did not die the scheduled way (exit 0, exit 1, SIGKILL)."""
    bad = []
    for s in specs:
        if s.kind != "crash" or notes.get(s.rank, {}).get("crash", {}).get("fault") != s.fid:
            continue
        death = res.dead.get(s.rank, "")
        if not death.startswith(DEATH_OF[s.how]):
            got = death.split(";")[0] or "did not die"
            bad.append(f"rank {s.rank} should have died by {DEATH_OF[s.how]} but: {got}")
    return bad


def apply_faults(res: CaseResult, case: Case, reply: Any, baseline: dict | None = None) -> None:
    """Adjust a judged faulted run in place, by the fault rules.

    - A case whose faults did not all fire is `invalid`, never `pass`: it tested nothing.
    - A send buffer overwritten while its send was in flight makes a completed run
      `silent-corruption`. A transport that reads the buffer late delivers the new data.
    - Under delay, straggler, early-read or send-reuse, a deterministic implementation must
      reproduce the fault-free hashes bit for bit. Otherwise the run is `diverged`.

    Last, it records whether the verdict is the one `expected_verdict` requires.
    """
    specs = parse_faults(case.faults, case.world_size)
    if not specs:
        return
    off = case.group_offset
    notes = {r - off: n for r, n in getattr(reply, "notes", {}).items()}
    fired = fired_counts(res, notes)
    expected = expected_verdict(specs)
    res.extra["fired"] = {s.fid: fired[s.fid] for s in specs}
    res.extra["expected"] = expected
    outcome, detail = res.verdict, res.detail
    # The ranks that could not report what fired on them.
    silent = set(res.dead) | set(res.hung)
    unfired = [s for s in specs if fired[s.fid] == 0]
    unknown = [s for s in unfired if (s.rank in silent if s.rank is not None else bool(silent))]
    missing = [s for s in unfired if s not in unknown]
    crash_bad = _crash_checks(specs, res, notes)
    violations = [
        v for rep in res.extra.get("faults", {}).values() for v in rep.get("violations", [])
    ]
    if unknown:
        res.extra["unverified"] = [s.fid for s in unknown]
        res.detail = "; ".join(
            [detail] * bool(detail)
            + [f"unverified (its rank died or hung): {s.describe()}" for s in unknown]
        )
    why = [f"fault never fired: {s.describe()}" for s in missing] + crash_bad
    # A hang is the finding, whatever else happened.
    if why and outcome == Verdict.HANG:
        res.detail = "; ".join([res.detail, *why])
    elif why:
        res.extra["outcome"] = outcome
        res.verdict = Verdict.INVALID
        res.detail = (
            "; ".join(why) + f" (the run was otherwise {outcome}{': ' + detail if detail else ''})"
        )
    elif violations:
        res.extra["violations"] = violations
        more = f" (+{len(violations) - 1} more)" if len(violations) > 1 else ""
        if res.verdict == Verdict.PASS:
            res.verdict = Verdict.SILENT_CORRUPTION
            res.detail = f"{violations[0]}{more}; a transport that reads the buffer at completion sends the new data"
        else:
            res.detail = f"{detail}; {violations[0]}{more}" if detail else violations[0] + more
    if res.verdict == Verdict.PASS and expected == Verdict.PASS and baseline is not None:
        _compare_baseline(res, baseline, _deterministic(reply))
    if res.verdict == Verdict.FAIL_STOP:
        _fail_stop_detail(res)
    res.extra["as_expected"] = res.verdict != Verdict.INVALID and (
        expected is None or res.verdict == expected
    )


def _deterministic(reply: Any) -> bool:
    return all(
        rep.get("deterministic", True)
        for rep in reply.replies.values()
        if rep.get("status") == "ok"
    )


def _compare_baseline(res: CaseResult, baseline: dict, deterministic: bool) -> None:
    """Benign faults must not change a deterministic ring's bits. If they do, it diverged."""
    res.extra["baseline_verdict"] = baseline.get("verdict")
    if baseline.get("verdict") != Verdict.PASS or not deterministic:
        return
    hashes = baseline.get("hashes", {})
    diffs = [
        f"{t}@rank{g}"
        for g, hs in sorted(res.hashes.items())
        for t, h in sorted(hs.items())
        if hashes.get(g, {}).get(t) != h
    ]
    res.extra["bit_identical"] = not diffs
    if diffs:
        res.verdict = Verdict.DIVERGED
        res.detail = f"results differ bit-wise from the fault-free run: {', '.join(diffs[:6])}"


def _fail_stop_detail(res: CaseResult) -> None:
    """Record which surviving ranks raised an error naming a peer and operation, and which
    completed.
    """
    alive = set(range(res.case.world_size)) - set(res.dead)
    clear = sorted(g for g, e in res.errors.items() if "peer rank" in e or "died" in e)
    completed = sorted(alive - set(res.errors))
    res.extra["clear_errors"] = clear
    res.extra["completed_ranks"] = completed
    if completed and "completed" not in res.detail:
        res.detail += f"; rank(s) {completed} completed before the failure reached them"
