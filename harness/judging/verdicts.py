"""Fault-aware verdicts: was every scheduled fault seen to fire, did the run end the way it must under
its faults, and did benign faults leave the results bit-identical to the fault-free run.

A case whose faults did not all fire is `invalid` (never `pass`): it tested nothing. A send buffer
overwritten while its send was in flight makes a completed run `silent-corruption` (a transport that
reads the buffer late delivers the new data). Under delay / straggler / early-read / send-reuse a
deterministic implementation must reproduce the fault-free hashes bit for bit, else `diverged`.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from harness.faults.schema import FaultSpec, expected_verdict, parse_faults

if TYPE_CHECKING:
    from harness.case import Case
    from harness.ranks.pool import PoolReply
    from harness.runner import CaseResult

DEATH_OF = {"exit0": "exit 0", "exit1": "exit 1", "sigkill": "killed by signal 9"}
_BASELINES: dict[tuple[str, str], dict] = {}
_BASELINES_MAX = 64


def fired_counts(res: CaseResult, notes: dict[int, dict]) -> Counter[int]:
    """Fault id -> times fired over every rank: the survivors' reports plus dead ranks' crash notes."""
    total: Counter[int] = Counter()
    for rep in res.extra.get("faults", {}).values():
        for fid, n in rep.get("fired", {}).items():
            total[int(fid)] += int(n)
    for note in notes.values():
        for fid, n in note.get("fired", {}).items():
            total[int(fid)] += int(n)
    return total


def _crash_checks(specs: tuple[FaultSpec, ...], res: CaseResult, notes: dict[int, dict]) -> list[str]:
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


def apply(res: CaseResult, case: Case, reply: PoolReply, baseline: dict | None = None) -> None:
    """Adjust a judged faulted run in place: invalid / violations / bit identity / expected verdict."""
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
    silent = set(res.dead) | set(res.hung)  # ranks that could not report what fired on them
    unfired = [s for s in specs if fired[s.fid] == 0]
    unknown = [s for s in unfired if (s.rank in silent if s.rank is not None else bool(silent))]
    missing = [s for s in unfired if s not in unknown]
    crash_bad = _crash_checks(specs, res, notes)
    violations = [v for rep in res.extra.get("faults", {}).values() for v in rep.get("violations", [])]
    if unknown:
        res.extra["unverified"] = [s.fid for s in unknown]
        res.detail = "; ".join([detail] * bool(detail) + [f"unverified (its rank died or hung): {s.describe()}"
                                                             for s in unknown])
    why = [f"fault never fired: {s.describe()}" for s in missing] + crash_bad
    if why and outcome == "hang":  # a hang is the finding whatever else happened
        res.detail = "; ".join([res.detail, *why])
    elif why:
        res.extra["outcome"] = outcome
        res.verdict = "invalid"
        res.detail = "; ".join(why) + f" (the run was otherwise {outcome}{': ' + detail if detail else ''})"
    elif violations:
        res.extra["violations"] = violations
        more = f" (+{len(violations) - 1} more)" if len(violations) > 1 else ""
        if res.verdict == "pass":
            res.verdict = "silent-corruption"
            res.detail = f"{violations[0]}{more}; a transport that reads the buffer at completion sends the new data"
        else:
            res.detail = f"{detail}; {violations[0]}{more}" if detail else violations[0] + more
    if res.verdict == "pass" and expected == "pass" and baseline is not None:
        _compare_baseline(res, baseline, _deterministic(reply))
    if res.verdict == "fail-stop":
        _fail_stop_detail(res)
    res.extra["as_expected"] = res.verdict != "invalid" and (expected is None or res.verdict == expected)


def _deterministic(reply: PoolReply) -> bool:
    return all(rep.get("deterministic", True) for rep in reply.replies.values() if rep.get("status") == "ok")


def _compare_baseline(res: CaseResult, baseline: dict, deterministic: bool) -> None:
    """Benign faults must not change a deterministic implementation's bits (else: diverged)."""
    res.extra["baseline_verdict"] = baseline.get("verdict")
    if baseline.get("verdict") != "pass" or not deterministic:
        return
    hashes = baseline.get("hashes", {})
    diffs = [f"{t}@rank{g}" for g, hs in sorted(res.hashes.items()) for t, h in sorted(hs.items())
             if hashes.get(g, {}).get(t) != h]
    res.extra["bit_identical"] = not diffs
    if diffs:
        res.verdict = "diverged"
        res.detail = f"results differ bit-wise from the fault-free run: {', '.join(diffs[:6])}"


def _fail_stop_detail(res: CaseResult) -> None:
    """Record which surviving ranks raised an error naming a peer and operation, and which completed."""
    alive = set(range(res.case.world_size)) - set(res.dead)
    clear = sorted(g for g, e in res.errors.items() if "peer rank" in e or "died" in e)
    completed = sorted(alive - set(res.errors))
    res.extra["clear_errors"] = clear
    res.extra["completed_ranks"] = completed
    if completed and "completed" not in res.detail:
        res.detail += f"; rank(s) {completed} completed before the failure reached them"


def baseline_for(case: Case, pool: Any, impl: str, allow_import: bool = False) -> dict | None:
    """The fault-free run of a case whose faults must not change results: {verdict, hashes}; cached."""
    if not case.faults or expected_verdict(parse_faults(case.faults, case.world_size)) != "pass":
        return None
    from harness.runner import run_case

    plain = case.replace(faults=())
    key = (impl, plain.key())
    if key not in _BASELINES:
        r = run_case(plain, pool, impl, allow_import=allow_import, leak=False)
        if len(_BASELINES) >= _BASELINES_MAX:
            _BASELINES.pop(next(iter(_BASELINES)))
        _BASELINES[key] = {"verdict": r.verdict, "hashes": r.hashes, "wall_s": r.timings.get("wall_s", 0.0),
                           "timings": r.timings}
    return _BASELINES[key]


def comm_steps(res: CaseResult, phase: str = "forward", kinds: tuple[str, ...] = ("isend", "send")) -> dict[int, int]:
    """Group rank -> number of ops of `kinds` in `phase` (reference ring: W-1 K/V sends in forward)."""
    out = {}
    for g, log in res.extra.get("comm", {}).items():
        out[g] = sum(1 for kind, _peer, _n, ph, _state in log if ph == phase and kind in kinds)
    return out
