"""`ring-harness selftest`: the default check against every mutant of the reference ring (the kill
matrix) and against the reference itself (false alarms); see harness.selftest.

Exit 0 when every mutant is killed and the reference passes, 1 otherwise, 2 on bad usage."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from harness.checks import check as check_run
from harness.checks import report, selftest
from harness.errors import HarnessError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="write the kill matrix and the false-alarm figures here")
    p.add_argument("--only", metavar="NAME,...", default=None,
                   help="these mutants only (names as in ring_impl.mutants; 'reference' is the false-alarm run)")
    p.add_argument("--false-alarm-cases", type=int, default=None, metavar="N",
                   help="property-based examples for the reference, with no time limit (default: the default "
                        "check's budget)")
    p.add_argument("--save-dir", default="ring-harness-selftest", metavar="DIR",
                   help="per-mutant check logs and found cases (default ./ring-harness-selftest)")
    p.add_argument("--corpus", default=None, metavar="DIR",
                   help="write each mutant's minimal case here as mutant-NAME.yaml (e.g. cases/); default: --save-dir")


def run(args: argparse.Namespace) -> int:
    from harness.ranks.pool import RankPool
    from harness.search.battery import battery_pool_size, default_battery
    from harness.search.fault_battery import leftover_workers
    from harness.search.fuzz import PROFILES

    if args.false_alarm_cases is not None and args.false_alarm_cases < 1:
        raise HarnessError(f"--false-alarm-cases must be at least 1, got {args.false_alarm_cases}")
    names = selftest.mutant_names(args.only)
    cargs = selftest.check_args()
    work = Path(args.save_dir)
    corpus = Path(args.corpus) if args.corpus else None
    prof = PROFILES[cargs.profile]
    ref = ""
    if selftest.REFERENCE in names:
        n = args.false_alarm_cases
        ref = " and the reference" + (f" (with {n} property-based examples, no time limit)" if n else "")
    report.out(f"ring-harness selftest: {sum(n != selftest.REFERENCE for n in names)} mutant(s){ref} through the "
               f"default check (battery W{cargs.world_size}, fault stage "
               f"{','.join(check_run.parse_fault_stage(cargs.fault_stage))}, property-based {prof.name}: "
               f"{prof.max_examples} examples / {prof.time_budget_s:g} s), {os.cpu_count()} cores; "
               f"logs in {work / 'logs'}")
    report.out(selftest.COLS)
    pids: set[int] = set()
    start = time.perf_counter()

    def done(r: selftest.MutantRun) -> None:
        pids.update(pool.pids())
        if r.name != selftest.REFERENCE:
            report.out(selftest.row(r))
            for line in selftest.notes(r):
                report.out(line)

    with RankPool(battery_pool_size(default_battery(cargs.world_size))) as pool:
        runs = selftest.run_selftest(pool, names, cargs, work, corpus, false_alarm_cases=args.false_alarm_cases,
                                     on_done=done)
        pids.update(pool.pids())
    leftovers = leftover_workers(pids)
    mutants = [r for r in runs if r.name != selftest.REFERENCE]
    ref = next((r for r in runs if r.name == selftest.REFERENCE), None)
    killed = sum(r.status == "killed" for r in mutants)
    median, worst, slowest = selftest.kill_times(runs)
    report.out("")
    if mutants:
        report.out(f"{killed}/{len(mutants)} mutants killed"
                   + (f"; time to first failure: median {median:.1f} s, worst {worst:.1f} s "
                      f"({selftest.short(slowest)})" if median is not None else ""))
        survivors = [selftest.short(r.name) for r in mutants if r.status != "killed"]
        if survivors:
            report.out(f"SURVIVED: {', '.join(survivors)}")
    if ref is not None:
        for line in selftest.false_alarm_lines(ref):
            report.out(line)
    report.out(f"selftest took {time.perf_counter() - start:.0f} s; worker processes left behind: {len(leftovers)}")
    for line in leftovers:
        report.out(f"  {line}")
    if args.json:
        report.write_json(args.json, {"command": "selftest", "mutants": [selftest.run_json(r) for r in mutants],
                                      "reference": None if ref is None else selftest.run_json(ref),
                                      "killed": killed, "median_kill_s": median, "worst_kill_s": worst,
                                      "leftovers": leftovers})
    return 0 if all(r.ok for r in runs) and not leftovers else 1
