"""The fault battery (`ring-harness check --faults KINDS`): run its cases
(harness.search.fault_battery), tally every verdict by fault kind, probe the pool's healing after
each failed case, measure the straggler slowdown, and check that no worker process was left behind
(checked, not assumed)."""

from __future__ import annotations

import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.case import Case, make_case
from harness.checks import report
from harness.checks.options import FAULT_BATTERY_PER_KIND, FaultBatteryOptions, parse_kinds
from harness.checks.report import Reporter
from harness.errors import HarnessError
from harness.faults.oplog import P2P_KINDS, uses_collectives
from harness.faults.schema import KINDS, make_fault
from harness.impls import registry
from harness.impls.capabilities import adapt
from harness.judging.verdicts import case_expected
from harness.ranks.leftovers import leftover_workers
from harness.result import VERDICTS, Verdict, save_result
from harness.runner import run_case
from harness.search import fault_battery as gen
from ring_impl.masks import MaskSpec


@dataclass
class BatteryOutcome:
    """Tallies of one battery run."""

    rows: list[tuple[str, object]] = field(default_factory=list)  # (kind, CaseResult)
    heal_failures: list[str] = field(default_factory=list)
    over_deadline: list[str] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    seconds: float = 0.0
    # worker processes still alive after the battery
    leftovers: list[str] = field(default_factory=list)
    hangs: int = 0

    @property
    def passed(self) -> bool:
        return not (
            self.unexpected()
            or self.hangs
            or self.over_deadline
            or self.heal_failures
            or self.leftovers
        )

    def table(self) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for kind, r in self.rows:
            out.setdefault(kind, Counter())[r.verdict] += 1
        return out

    def unexpected(self) -> list[tuple[str, object]]:
        return [(k, r) for k, r in self.rows if not r.extra.get("as_expected", False)]


def run_battery(
    cases: list[Case],
    pool,
    impl: str,
    *,
    allow_import: bool = False,
    on_result: Callable[[int, str, object], None] | None = None,
    heal: bool = True,
    out: BatteryOutcome | None = None,
) -> BatteryOutcome:
    """Run every case; after a case that broke the pool (or its group), a fault-free run of the same
    case must pass on the healed pool. Worker pids are recorded for the leftover check."""
    out = BatteryOutcome() if out is None else out
    start = time.perf_counter()
    for i, c in enumerate(cases, 1):
        r = run_case(c, pool, impl, allow_import=allow_import)
        out.pids.update(pool.pids())
        kind = gen.kind_of(c)
        out.rows.append((kind, r))
        slack = 3.0  # stack collection and reply transfer after the deadline
        if r.timings.get("wall_s", 0.0) > c.deadline_s + slack:
            out.over_deadline.append(
                f"case {i} ({kind}): {r.timings['wall_s']:.1f} s > deadline {c.deadline_s:g} s"
            )
        if on_result is not None:
            on_result(i, kind, r)
        if heal and (pool.broken or pool.fresh_group):
            probe = run_case(
                c.replace(faults=()), pool, impl, allow_import=allow_import, leak=False
            )
            out.pids.update(pool.pids())
            r.extra["heal"] = probe.verdict
            if not probe.passed:
                out.heal_failures.append(
                    f"case {i} ({kind}): fault-free rerun was {probe.verdict}: {probe.detail}"
                )
    out.seconds = time.perf_counter() - start
    return out


def measure_straggler(
    pool,
    impl: str,
    *,
    factor: float = 4.0,
    world_size: int = 2,
    rank: int = 1,
    reps: int = 5,
    allow_import: bool = False,
    tokens_per_rank: int = 512,
) -> dict:
    """Ring time (slowest rank's forward + backward) with one rank `factor` times slower at compute,
    against the fault-free ring: the straggler slowdown of the whole ring, medians over `reps`
    (after one warm-up run of each)."""
    base = make_case(
        world_size=world_size,
        total_len=world_size * tokens_per_rank,
        layout="zigzag",
        mask=MaskSpec("causal"),
        heads_q=4,
        heads_kv=4,
        head_dim=32,
        seed=7,
        impl=impl,
        deadline_s=120.0,
    )
    slow = base.replace(faults=(make_fault("straggler", rank=rank, factor=factor),))
    times: dict[str, list[float]] = {"base": [], "slow": []}
    verdicts = []
    for i in range(reps + 1):
        for name, c in (("base", base), ("slow", slow)):
            r = run_case(c, pool, impl, allow_import=allow_import, leak=False)
            verdicts.append(r.verdict)
            per_rank = [
                v.get("forward_s", 0.0) + v.get("backward_s", 0.0)
                for k, v in r.timings.items()
                if k.startswith("rank") and isinstance(v, dict)
            ]
            if i > 0:  # the first run of each warms up (lazy init, first connections)
                times[name].append(max(per_rank) if per_rank else float("nan"))
    b, s = statistics.median(times["base"]), statistics.median(times["slow"])
    # least disturbed by other load on the machine
    b_min, s_min = min(times["base"]), min(times["slow"])
    return {
        "factor": factor,
        "world": world_size,
        "rank": rank,
        "reps": reps,
        "base_s": b,
        "slow_s": s,
        "slowdown": s / b if b > 0 else float("nan"),
        "slowdown_min": s_min / b_min if b_min > 0 else float("nan"),
        "times": times,
        "verdicts": verdicts,
        "summary": base.summary(),
    }


def table_lines(res: BatteryOutcome) -> list[str]:
    """The fault kind x verdict table, with each kind's expected verdict and how many met it."""
    tab = res.table()
    head = f"{'fault':<11} {'cases':>5} " + " ".join(f"{v:>{max(len(v), 4)}}" for v in VERDICTS)
    head += f"  {'expected':<9} {'as-expected':>11}  {'max s':>5}"
    lines = [head, "-" * len(head)]
    kinds = [k for k in (*KINDS, "none") if k in tab]
    for k in kinds:
        rs = [r for kk, r in res.rows if kk == k]
        exp = case_expected(rs[0].case)
        ok = sum(1 for r in rs if r.extra.get("as_expected", False))
        cells = " ".join(f"{tab[k][v]:>{max(len(v), 4)}}" for v in VERDICTS)
        worst = max(r.timings.get("wall_s", 0.0) for r in rs)
        lines.append(
            f"{k:<11} {len(rs):>5} {cells}  {exp or 'any':<9} {f'{ok}/{len(rs)}':>11}  {worst:5.1f}"
        )
    total = Counter()
    for c in tab.values():
        total.update(c)
    cells = " ".join(f"{total[v]:>{max(len(v), 4)}}" for v in VERDICTS)
    ok = sum(1 for _, r in res.rows if r.extra.get("as_expected", False))
    lines.append(f"{'total':<11} {len(res.rows):>5} {cells}  {'':<9} {f'{ok}/{len(res.rows)}':>11}")
    return lines


def fault_battery(
    opts: FaultBatteryOptions | None = None, reporter: Reporter | None = None
) -> BatteryOutcome:
    """Run the battery on a local pool and print the table. `outcome.passed` only if every case
    ended as it must, none hung past its deadline, every healed pool passed a fault-free case, and
    no worker process was left."""
    opts = (opts or FaultBatteryOptions()).validate()
    out = reporter or report.out
    kinds = parse_kinds(opts.kinds, KINDS, "--faults", KINDS, allow_all=True)
    cases = _battery_cases(opts, kinds, out)
    out(
        f"ring-harness check --faults {','.join(kinds)}: {len(cases)} faulted cases, impl "
        f"{opts.impl}, "
        f"gloo ranks, deadline {opts.deadline:g} s"
    )
    res = BatteryOutcome()
    straggler = _run_on_pool(cases, kinds, opts, out, res)
    leftovers = leftover_workers(res.pids)
    out("")
    for line in table_lines(res):
        out(line)
    hangs = sum(1 for _, r in res.rows if r.verdict == Verdict.HANG)
    for line in _summary_lines(res, hangs, straggler, leftovers):
        out(line)
    _save_unexpected(res, opts.save_dir, out)
    if opts.json:
        _write_json(opts, res, straggler, leftovers)
    res.leftovers, res.hangs = leftovers, hangs
    return res


def _battery_cases(
    opts: FaultBatteryOptions, kinds: list[str], out: Reporter, collective: bool = False
) -> list[Case]:
    """The battery's cases of `kinds` that the implementation declares; none is an error.

    `collective`: the ring makes no P2P op, so the faults select collectives.
    """
    n = opts.cases if opts.cases is not None else FAULT_BATTERY_PER_KIND * len(kinds)
    max_world = max(2, min(opts.world_size, 4))
    cases = gen.fault_cases(
        kinds,
        n,
        impl=opts.impl,
        seed=opts.seed,
        deadline_s=opts.deadline,
        max_world=max_world,
        collective=collective,
    )
    cases, skipped = _supported(cases, opts.impl, opts.allow_import)
    if not cases:
        raise HarnessError(f"{opts.impl} declares support for none of the fault battery's cases")
    if skipped:
        out(f"skipping {skipped} case(s) with features {opts.impl} does not declare")
    return cases


def _case_line(i: int, n: int, kind: str, r) -> str:
    """One case's progress line: its number, fault kind, summary, verdict and time."""
    mark = "" if r.extra.get("as_expected") else "  UNEXPECTED"
    detail = f"  {r.detail[:150]}" if r.detail and r.verdict != Verdict.PASS else ""
    summary = r.case.summary().replace(f" faults={len(r.case.faults)}", "")[:52]
    return (
        f"{i:>4}/{n} {kind:<10} {summary:<52} {r.verdict:<17} "
        f"{r.timings.get('wall_s', 0.0):5.2f}s{mark}{detail}"
    )


def _show(out: Reporter, n: int, i: int, kind: str, r) -> None:
    """Print a case's progress line as it finishes (run_battery's `on_result`)."""
    out(_case_line(i, n, kind, r))


def _run_on_pool(
    cases: list[Case],
    kinds: list[str],
    opts: FaultBatteryOptions,
    out: Reporter,
    res: BatteryOutcome,
) -> dict | None:
    """Run the cases into `res` on one spare pool, then the straggler figure when it is asked for.

    Returns the straggler figure (None when not measured).
    """
    from harness.ranks.pool import RankPool

    allow_import = opts.allow_import
    pool = RankPool(max(c.pool_size for c in cases), spare=True, placement=opts.placement)
    straggler = None
    try:
        if _collectives_only(pool, cases[0], opts.impl, allow_import):
            out("the ring makes no P2P op, only collectives: the faults select collectives")
            cases[:] = _battery_cases(opts, kinds, out, collective=True)
        show = functools.partial(_show, out, len(cases))
        run_battery(cases, pool, opts.impl, allow_import=allow_import, on_result=show, out=res)
        if "straggler" in kinds and "straggler" in {gen.kind_of(c) for c in cases}:
            out(
                "measuring the straggler slowdown (fault-free vs one rank 4x slower at compute) ..."
            )
            straggler = measure_straggler(pool, opts.impl, allow_import=allow_import)
            res.pids.update(pool.pids())
    finally:
        pool.close()
    return straggler


def _collectives_only(pool, case: Case, impl: str, allow_import: bool) -> bool:
    """Whether a fault-free run of `case` shows collectives and no P2P op (its op log)."""
    r = run_case(case.replace(faults=()), pool, impl, allow_import=allow_import, leak=False)
    comm = r.extra.get("comm", {})
    p2p = any(entry[0] in P2P_KINDS for log in comm.values() for entry in log)
    return uses_collectives(comm) and not p2p


def _summary_lines(
    res: BatteryOutcome, hangs: int, straggler: dict | None, leftovers: list[str]
) -> list[str]:
    """The lines under the table: hangs, deadlines, healing, the straggler figure, leftovers."""
    lines = [
        f"{len(res.rows)} faulted cases in {res.seconds:.1f} s; hangs: {hangs}; past the deadline: "
        f"{len(res.over_deadline)}; pool healed after every failed case: "
        f"{'yes' if not res.heal_failures else f'NO ({len(res.heal_failures)})'}"
    ]
    lines += [f"  {line}" for line in res.over_deadline + res.heal_failures]
    if straggler is not None:
        lines.append(
            f"straggler: {straggler['summary']}, rank {straggler['rank']} x{straggler['factor']:g} "
            "slower: "
            f"ring forward+backward {straggler['base_s']:.3f} s -> "
            f"{straggler['slow_s']:.3f} s, "
            f"slowdown x{straggler['slowdown']:.2f} (median of {straggler['reps']}; "
            f"x{straggler['slowdown_min']:.2f} between the fastest runs)"
        )
    lines.append(
        f"worker processes left behind: {len(leftovers)} (checked the {len(res.pids)} worker pids "
        "this battery "
        "started and their process groups)"
    )
    lines += [f"  {line}" for line in leftovers]
    return lines


def _save_unexpected(res: BatteryOutcome, save_dir: str, out: Reporter) -> None:
    """Save each case that did not end as it must, and print where."""
    for kind, r in res.unexpected():
        path = save_result(
            r,
            save_dir,
            note=f"fault battery ({kind}): {r.verdict}, expected "
            f"{r.extra.get('expected') or 'any'}\n{r.detail}",
        )
        out(
            f"  unexpected: {kind} {r.case.summary()} -> {r.verdict} (expected "
            f"{r.extra.get('expected') or 'any'}): {r.detail[:200]}; saved {path}"
        )


def _write_json(
    opts: FaultBatteryOptions, res: BatteryOutcome, straggler: dict | None, leftovers: list[str]
) -> None:
    """The battery's machine-readable results (--json)."""
    report.write_json(
        opts.json,
        {
            "command": "check --faults",
            "impl": opts.impl,
            "seconds": res.seconds,
            "table": {k: dict(v) for k, v in res.table().items()},
            "straggler": straggler,
            "leftovers": leftovers,
            "heal_failures": res.heal_failures,
            "over_deadline": res.over_deadline,
            "results": [r.to_dict() for _, r in res.rows],
        },
    )


def _supported(cases: list, impl: str, allow_import: bool) -> tuple[list, int]:
    """The battery's cases the implementation declares (adapted to its split/head_dim when that is
    all)."""
    caps = registry.resolve(impl, allow_import=allow_import).capabilities
    out = [adapt(caps, c) for c in cases]
    kept = [c for c in out if c is not None]
    return kept, len(cases) - len(kept)
