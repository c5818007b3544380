"""Judging one case: the ranks' replies in, a `CaseResult` with exactly one `Verdict` out.

The first verdict that applies wins: hang, fail-stop, diverged, then silent corruption. A faulted
case then goes through the fault rules (`harness.judging.verdicts.apply_faults`). Judging never
runs a case and never computes the oracle: the caller passes in the oracle's outputs, and
`needs_oracle` says when they are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.case import Case
from harness.judging.tensor_checks import check_leak, check_tensors, lse_base_slip
from harness.judging.verdicts import apply_faults
from harness.oracle.assemble import Pair
from harness.result import CaseResult, Verdict

# Error maps are kept when batch * tokens * heads is at most this.
MAP_LIMIT = 1 << 22


def judge(
    case: Case,
    impl: str,
    reply: Any,
    outputs: Pair | None,
    oracle_s: float = 0.0,
    keep_shards: bool = False,
    baseline: dict | None = None,
) -> CaseResult:
    """Turn the ranks' replies into a CaseResult with exactly one verdict.

    `reply` is a `harness.ranks.protocol.PoolReply`. `outputs` is the oracle's (exact, base) pair.
    It may be None only when `needs_oracle` says False. A faulted case's verdict then accounts for
    its faults (`apply_faults`).
    """
    res = _judge(case, impl, reply, outputs, oracle_s, keep_shards)
    if case.faults:
        apply_faults(res, case, reply, baseline)
    return res


def needs_oracle(case: Case, reply: Any) -> bool:
    """Whether judging these replies compares tensors with the oracle.

    It does when no ring rank hung, died, raised or diverged, and no rank outside the ring failed.
    """
    got = _gather(case, "-", reply, 0.0)
    return not _stopped(got, case)


@dataclass
class _Replies:
    """The ranks' replies of one case, sorted out by group rank."""

    res: CaseResult
    shards: dict = field(default_factory=dict)
    leak_shards: dict = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)
    when: dict[int, float] = field(default_factory=dict)  # group rank -> time.time() of its error
    outside: dict = field(default_factory=dict)  # failed ranks outside the ring group


def _gather(case: Case, impl: str, reply: Any, oracle_s: float) -> _Replies:
    """A CaseResult, pass so far, with the replies' hangs, deaths, errors, hashes and timings.

    It also holds the ring ranks' tensors.
    """
    off = case.group_offset
    in_group = range(off, off + case.world_size)
    res = CaseResult(case=case, impl=impl, verdict=Verdict.PASS)
    res.timings = {"wall_s": reply.wall_s, "oracle_s": oracle_s, "pool_restarted": reply.restarted}
    res.hung = {r - off: s for r, s in reply.hung.items() if r in in_group}
    res.dead = {r - off: s for r, s in reply.dead.items()}
    got = _Replies(
        res, outside={r: s for r, s in {**reply.hung, **reply.dead}.items() if r not in in_group}
    )
    for r, rep in reply.replies.items():
        if r not in in_group:
            continue
        g = r - off
        got.statuses[g] = rep.get("status")
        if rep.get("status") == "ok":
            got.shards[g] = rep["tensors"]
            res.hashes[g] = rep["hashes"]
            res.timings[f"rank{g}"] = rep.get("timings", {})
            if "leak" in rep:
                got.leak_shards[g] = rep["leak"]
        elif rep.get("error"):
            res.errors[g] = rep["error"]
            got.when[g] = float(rep.get("error_time", 0.0))
            if rep.get("where"):
                res.extra.setdefault("where", {})[g] = rep["where"]
        for k in ("comm", "faults"):
            if k in rep:
                res.extra.setdefault(k, {})[g] = rep[k]
        # the flash-attn kernel a flash-attn library ran on (e.g. cpu-standin)
        if rep.get("kernel"):
            res.extra["kernel"] = rep["kernel"]
    return got


def _stopped(got: _Replies, case: Case) -> bool:
    """Set the verdict of a run that did not complete (hang, fail-stop, diverged); True if so."""
    res = got.res
    if res.hung:
        res.verdict = Verdict.HANG
        res.detail = (
            f"deadline {case.deadline_s:g} s passed; rank(s) {sorted(res.hung)} still running"
        )
        res.detail += "".join(f"; {w}" for w in _pending_ops(res.hung))
        return True
    if got.outside:
        res.verdict = Verdict.FAIL_STOP
        res.detail = f"ranks outside the ring group failed: {sorted(got.outside)}"
        return True
    if any(s == "diverged" for s in got.statuses.values()):
        res.verdict = Verdict.DIVERGED
        res.detail = "; ".join(f"rank {g}: {res.errors[g]}" for g in sorted(res.errors))
        return True
    if res.errors or res.dead:
        res.verdict = Verdict.FAIL_STOP
        res.detail, res.extra["root_cause"] = _fail_stop_story(res, got.when)
        return True
    return False


def _judge(
    case: Case, impl: str, reply: Any, outputs: Pair | None, oracle_s: float, keep_shards: bool
) -> CaseResult:
    """The verdict before faults are counted.

    The first that applies wins: hang (a rank passed the deadline), fail-stop (a rank raised or
    died), diverged (a wrong shape), silent-corruption (a tensor over its tolerance, or a causality
    leak). Otherwise the case passes.
    """
    got = _gather(case, impl, reply, oracle_s)
    res = got.res
    if _stopped(got, case):
        return res
    if outputs is None:
        raise ValueError(
            f"{case.summary()}: judging needs the oracle's outputs; the caller computes them"
        )
    exact, base = outputs
    small = case.batch * case.total_len * case.heads_q <= MAP_LIMIT
    res.checks = check_tensors(case, got.shards, exact, base, maps=res.maps if small else None)
    if keep_shards:
        res.shards = got.shards
    res.leak = check_leak(case, got.leak_shards)
    bad = res.failed_checks()
    if bad or (res.leak is not None and not res.leak.passed):
        res.verdict = Verdict.SILENT_CORRUPTION
        parts = [
            f"{c.tensor}@rank{c.rank} "
            + (
                f"x{c.ratio:.3g}"
                if c.ratio > 1 or not c.grid
                else f"on the {c.grid} grid (precision lost)"
            )
            for c in sorted(bad, key=lambda c: -c.ratio)[:4]
        ]
        if res.leak is not None and res.leak.leaks:
            lk = res.leak.leaks[0]
            parts.append(
                f"leak: {lk['tensor']} nonzero at hidden key {lk['token']} on rank {lk['rank']}"
            )
        slip = _lse_slip(case, got.shards, exact, bad)
        if slip:
            parts.insert(0, slip)
        res.detail = "; ".join(parts)
    return res


def _lse_slip(case: Case, shards: dict, exact, bad: list) -> str:
    """The lse's base named, when the failed lse checks are right in the other base."""
    lse_checks = [c for c in bad if c.tensor == "lse"]
    if not lse_checks:
        return ""
    return lse_base_slip(case, shards, exact, max(c.allowed for c in lse_checks))


def _fail_stop_story(res: CaseResult, when: dict[int, float]) -> tuple[str, list[int]]:
    """The fail-stop detail, root cause first, and the ranks of the root cause.

    The root cause is the earliest error a rank raised, or the ranks that died. A rank that raises
    closes its connections, so the errors it causes on the others come after it. The other ranks'
    errors follow as consequences.
    """
    raised = sorted(res.errors, key=lambda g: (when.get(g, float("inf")), g))
    # A death is the cause of the errors it provokes.
    if res.dead:
        root = sorted(res.dead)
        parts = [f"rank {g} died ({d.split(';')[0]})" for g, d in sorted(res.dead.items())]
        later = raised
    else:
        root, parts, later = (
            raised[:1],
            [f"rank {g}: {res.errors[g]}" for g in raised[:1]],
            raised[1:],
        )
    detail = "; ".join(parts)
    if later:
        detail += "; consequences: " + "; ".join(f"rank {g}: {res.errors[g]}" for g in later)
    return detail, root


def _pending_ops(hung: dict[int, str]) -> list[str]:
    """'rank g last blocked waiting on <op>, pending <op>, ...' from the hung ranks' reports."""
    head, out = "pending ops: ", []
    for _, text in sorted(hung.items()):
        lines = text.splitlines()
        if lines and lines[0].startswith(head):
            rest = [ln.strip() for ln in lines[1:] if ln.startswith("  pending ")]
            out.append(", ".join([lines[0][len(head) :], *rest]))
    return out
