"""The fault stage: buffer-discipline faults on every rank and every op of both phases.

Results must not change under them. A bug then shows deterministically: a read before its wait sees
NaN, and an overwrite of a buffer being sent (or of a collective's input) is caught when it
happens. A ring whose op log shows collectives also gets one case per shape with one rank late to
every collective: a blocking collective gives early-read and send-reuse nothing to act on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.case import Case, make_case
from harness.checks import report
from harness.checks.options import FAULT_STAGE_DEFAULT, FAULT_STAGE_KINDS, CheckOptions, parse_kinds
from harness.context import Capabilities
from harness.faults.oplog import uses_collectives
from harness.faults.schema import make_fault
from harness.impls.capabilities import adapt
from harness.judging.run_record import record_of
from harness.judging.verdicts import fault_ok
from harness.result import CaseResult, Verdict
from harness.runner import run_case
from ring_impl.masks import MaskSpec

if TYPE_CHECKING:
    from harness.checks.check import Check

name = "faults"  # the stage's name (harness.checks.stages.Stage)

# (world size, tokens, layout, mask) of the fault stage: W = 2 for the dk/dv ring, W >= 3 for a
# forward K/V slot that is received into while it is still being sent.
SHAPES = (
    (2, 9, "contiguous", MaskSpec("none")),
    (3, 14, "zigzag", MaskSpec("causal")),
    (4, 21, "striped", MaskSpec("window", window=3)),
)


# one rank late to every collective: the others wait inside it
LATE = {"seconds": 0.005, "jitter": 0.005, "where": "post"}


def _stage_fault(kind: str, world_size: int) -> dict:
    """`kind` on every rank and every op of both phases (a straggler needs one rank: the last).

    send-reuse watches sends and collectives' inputs alike.
    """
    if kind == "straggler":
        return make_fault(kind, rank=world_size - 1)
    return make_fault(kind, op="any") if kind == "send-reuse" else make_fault(kind)


def collective_cases(cases: list[Case]) -> list[Case]:
    """Per shape, its first case with the last rank late to every collective instead.

    The same case without faults is the baseline the first one already ran (runner.baseline_for).
    """
    out, seen = [], set()
    for c in cases:
        if c.world_size in seen:
            continue
        seen.add(c.world_size)
        late = make_fault("delay", rank=c.world_size - 1, op="collective", **LATE)
        out.append(c.replace(faults=(late,)))
    return out


def plan(
    kinds: tuple[str, ...],
    impl: str,
    caps: Capabilities,
    *,
    max_world: int,
    deadline_s: float,
    dtype: str | None = None,
) -> list[Case]:
    """Per shape, one case per kind and one with all kinds at once, each fault on every rank and op.

    With early-read and send-reuse together, every byte moves at a point fixed by the program
    order. So even a racy implementation's wrong numbers are the same on every run: replayable bit
    for bit.
    """
    out = []
    for w, total, layout, mask in SHAPES:
        if w > max_world:
            continue
        for group in [(k,) for k in kinds] + ([kinds] if len(kinds) > 1 else []):
            c = make_case(
                world_size=w,
                total_len=total,
                layout=layout,
                mask=mask,
                heads_q=4,
                heads_kv=2,
                head_dim=8,
                seed=100 + len(out),
                impl=impl,
                dtype=dtype or "fp32",
                deadline_s=deadline_s,
                faults=tuple(_stage_fault(k, w) for k in group),
            )
            c = adapt(caps, c)
            if c is not None:
                out.append(c)
    return out


def ranks(opts: CheckOptions, caps: Capabilities) -> int:
    """None of its own: it runs the shapes that fit the pool it gets."""
    return 0


def _cases(check: Check, kinds: tuple[str, ...]) -> list[Case]:
    """The stage's cases for the pool and the declared ring sizes."""
    opts, caps = check.opts, check.caps
    lo, hi = caps.world_sizes
    deadline = min(opts.fault_deadline, opts.deadline or opts.fault_deadline)
    cases = plan(
        kinds,
        opts.impl,
        caps,
        max_world=min(hi, check.pool.capacity),
        deadline_s=deadline,
        dtype=opts.dtype,
    )
    return [c for c in cases if c.world_size >= lo]


def _clean_cause(check: Check, c: Case) -> tuple[str, ...] | None:
    """The same case without its faults: its signature when it fails too, else None.

    A ring that fails without faults is not racy: its faulted failure belongs to that failure's
    group (harness.checks.groups). One run, about the ring's own time.
    """
    opts = check.opts
    r = run_case(c.replace(faults=()), check.pool, opts.impl, allow_import=opts.allow_import)
    rec = record_of(r, "fault-free re-run")
    check.outcome.clean_reruns.append(rec)
    if rec.passed:
        return None
    check.reporter(f"        the same case without faults fails too: {r.verdict} ({rec.cause[-1]})")
    return rec.cause


def run(check: Check) -> bool:
    """Run the fault stage into `check.outcome`. True: the check stops at one of its failures."""
    opts, out = check.opts, check.reporter
    kinds = parse_kinds(opts.fault_stage, FAULT_STAGE_KINDS, "--fault-stage", FAULT_STAGE_DEFAULT)
    if not kinds:
        return False
    cases = _cases(check, kinds)
    out(
        f"fault stage: {len(cases)} cases, {', '.join(kinds)} on every rank, both phases "
        "(results must not change)"
    )
    collective = False
    for i, c in enumerate(cases, 1):
        r = _one(check, i, len(cases), c)
        if r is None:
            return True
        collective = collective or uses_collectives(r.extra.get("comm", {}))
    more = collective_cases(cases) if collective and "delay" not in kinds else []
    if more:
        out(
            f"fault stage: the ring uses collectives: {len(more)} more cases, the last rank late "
            "to every collective (results must not change)"
        )
    # any() stops at the first case that stops the check
    return any(_one(check, i, len(more), c) is None for i, c in enumerate(more, 1))


def _one(check: Check, i: int, n: int, c: Case) -> CaseResult | None:
    """Run one case of the stage and report it; None: the check stops at its failure."""
    opts, out = check.opts, check.reporter
    r = run_case(c, check.pool, opts.impl, allow_import=opts.allow_import)
    check.outcome.fault_results.append(r)
    check.outcome.cases += 1
    out(report.row(i, n, r) + f"  [{'+'.join(f['kind'] for f in c.faults)}]")
    if r.verdict == Verdict.INVALID:
        out(f"        -> not applicable here: {r.detail[:200]}")
    elif not fault_ok(r):
        if r.detail:
            out(f"        -> {r.detail[:300]}")
        else:
            out(f"        -> {r.verdict}, expected pass")
        check.save_failure(r, cause=_clean_cause(check, c))
        if check.record_failure(name, r):
            done, failing = len(check.outcome.fault_results), len(check.outcome.failures)
            check.stop(f"stopped at fault stage case {done} ({failing} failing)")
            return None
    return r
