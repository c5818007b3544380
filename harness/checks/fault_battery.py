"""`ring-harness check --faults KINDS`: run the fault battery and print the fault kind x verdict table,
the straggler slowdown and the leftover-process check."""

from __future__ import annotations

import argparse

from harness.checks import report

DEFAULT_PER_KIND = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The fault battery's options on `check` (kept here so check.py stays small)."""
    p.add_argument("--faults", metavar="KINDS", default=None,
                   help="run the fault battery instead: comma list of delay, drop, early-read, send-reuse, "
                        "corrupt, straggler, crash, or 'all'")
    p.add_argument("--fault-cases", type=int, default=None, metavar="N",
                   help=f"faulted cases in the fault battery (default {DEFAULT_PER_KIND} per kind)")
    p.add_argument("--fault-deadline", type=float, default=8.0, metavar="SECONDS",
                   help="per-case deadline of the fault battery (default 8; drop/crash cases end by it)")
    p.add_argument("--fault-seed", type=int, default=0, metavar="N", help="seed of the fault battery (default 0)")


def run(args: argparse.Namespace) -> int:
    """Run the battery on a local pool; exit 0 only if every case ended as it must, none hung past
    its deadline, every healed pool passed a fault-free case, and no worker process was left."""
    from harness.errors import HarnessError
    from harness.ranks.pool import RankPool
    from harness.result import save_result
    from harness.search import fault_battery as battery

    if getattr(args, "launcher", "local") != "local":
        raise HarnessError("--faults runs on the local pool (it kills and restarts ranks); drop --launcher")
    kinds = battery.parse_kinds(args.faults)
    n = args.fault_cases if args.fault_cases is not None else DEFAULT_PER_KIND * len(kinds)
    if not 1 <= args.fault_deadline <= 600:
        raise HarnessError(f"--fault-deadline must be in [1, 600] seconds, got {args.fault_deadline:g}")
    max_world = max(2, min(getattr(args, "world_size", 4), 4))
    cases = battery.fault_cases(kinds, n, impl=args.impl, seed=args.fault_seed, deadline_s=args.fault_deadline,
                                max_world=max_world)
    allow_import = ":" in args.impl
    cases, skipped = _supported(cases, args.impl, allow_import)
    if not cases:
        raise HarnessError(f"{args.impl} declares support for none of the fault battery's cases")
    if skipped:
        report.out(f"skipping {skipped} case(s) with features {args.impl} does not declare")
    report.out(f"ring-harness check --faults {','.join(kinds)}: {len(cases)} faulted cases, impl {args.impl}, "
               f"gloo ranks, deadline {args.fault_deadline:g} s")

    def show(i: int, kind: str, r) -> None:
        mark = "" if r.extra.get("as_expected") else "  UNEXPECTED"
        detail = f"  {r.detail[:150]}" if r.detail and r.verdict != "pass" else ""
        summary = r.case.summary().replace(f" faults={len(r.case.faults)}", "")[:52]
        report.out(f"{i:>4}/{len(cases)} {kind:<10} {summary:<52} {r.verdict:<17} "
                   f"{r.timings.get('wall_s', 0.0):5.2f}s{mark}{detail}")

    pool = RankPool(max(c.pool_size for c in cases))
    straggler = None
    res = battery.BatteryResult()
    try:
        battery.run_battery(cases, pool, args.impl, allow_import=allow_import, on_result=show, out=res)
        if "straggler" in kinds and "straggler" in {battery.kind_of(c) for c in cases}:
            report.out("measuring the straggler slowdown (fault-free vs one rank 4x slower at compute) ...")
            straggler = battery.measure_straggler(pool, args.impl, allow_import=allow_import)
            res.pids.update(pool.pids())
    finally:
        pool.close()
    leftovers = battery.leftover_workers(res.pids)
    report.out("")
    for line in battery.table_lines(res):
        report.out(line)
    hangs = sum(1 for _, r in res.rows if r.verdict == "hang")
    report.out(f"{len(res.rows)} faulted cases in {res.seconds:.1f} s; hangs: {hangs}; past the deadline: "
               f"{len(res.over_deadline)}; pool healed after every failed case: "
               f"{'yes' if not res.heal_failures else f'NO ({len(res.heal_failures)})'}")
    for line in res.over_deadline + res.heal_failures:
        report.out(f"  {line}")
    if straggler is not None:
        report.out(f"straggler: {straggler['summary']}, rank {straggler['rank']} x{straggler['factor']:g} slower: "
                   f"ring forward+backward {straggler['base_s']:.3f} s -> {straggler['slow_s']:.3f} s, "
                   f"slowdown x{straggler['slowdown']:.2f} (median of {straggler['reps']}; "
                   f"x{straggler['slowdown_min']:.2f} between the fastest runs)")
    report.out(f"worker processes left behind: {len(leftovers)} (checked {len(res.pids)} worker pids and "
               f"/proc for harness.ranks.worker children of this process)")
    for line in leftovers:
        report.out(f"  {line}")
    bad = res.unexpected()
    for kind, r in bad:
        path = save_result(r, args.save_dir, note=f"fault battery ({kind}): {r.verdict}, expected "
                                                  f"{r.extra.get('expected') or 'any'}\n{r.detail}")
        report.out(f"  unexpected: {kind} {r.case.summary()} -> {r.verdict} (expected "
                   f"{r.extra.get('expected') or 'any'}): {r.detail[:200]}; saved {path}")
    if args.json:
        report.write_json(args.json, {"command": "check --faults", "impl": args.impl, "seconds": res.seconds,
                                      "table": {k: dict(v) for k, v in res.table().items()},
                                      "straggler": straggler, "leftovers": leftovers,
                                      "heal_failures": res.heal_failures, "over_deadline": res.over_deadline,
                                      "results": [r.to_dict() for _, r in res.rows]})
    ok = not bad and not hangs and not res.over_deadline and not res.heal_failures and not leftovers
    return 0 if ok else 1


def _supported(cases: list, impl: str, allow_import: bool) -> tuple[list, int]:
    """The battery's cases the implementation declares (adapted to its split/head_dim when that is all)."""
    from harness.impls import registry
    from harness.impls.capabilities import adapt, unsupported

    caps = registry.resolve(impl, allow_import=allow_import).capabilities
    out = [c if not unsupported(caps, c) else adapt(caps, c) for c in cases]
    kept = [c for c in out if c is not None]
    return kept, len(cases) - len(kept)
