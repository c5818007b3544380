"""`ring-harness check`: the default check (harness.check_run: fixed battery, fault stage, property-based
run) against one implementation on a pool of ranks, or the fault battery with --faults."""

from __future__ import annotations

import argparse

from harness.checks import check as check_run
from harness.checks import fault_battery as fault_command
from harness.checks import property as fuzz_report
from harness.checks import report
from harness.impls import registry
from harness.ranks.launch import open_pool
from harness.search.battery import battery_pool_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", default="reference",
                   help="implementation: a built-in name (see `ring-harness impls`) or package.module:attr")
    p.add_argument("--world-size", type=int, default=4, help="main ring size of the battery (default 4)")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="run every case in this dtype")
    p.add_argument("--json", metavar="FILE", help="write machine-readable results here")
    p.add_argument("--save-dir", default="ring-harness-failures", metavar="DIR",
                   help="where failing cases are written as YAML (default ./ring-harness-failures)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS", help="per-case deadline")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="default: gloo for the local pool; nccl under torchrun when CUDA is available")
    p.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                   help="local: a pool of worker processes on this host; torchrun: the ranks torchrun started")
    fuzz_report.add_arguments(p)
    check_run.add_arguments(p)
    fault_command.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from harness.errors import HarnessError

    if not 1 <= args.world_size <= 64:
        raise HarnessError(f"--world-size must be in 1..64, got {args.world_size}")
    if args.faults:
        return fault_command.run(args)
    fuzz_report.check_options(args)
    check_run.parse_fault_stage(args.fault_stage)
    caps = registry.resolve(args.impl, allow_import=":" in args.impl).capabilities
    cases, probes = check_run.battery_plan(args, args.impl, caps)
    with open_pool(args.launcher, args.backend, battery_pool_size(cases + probes)) as pool:
        if pool is None:  # a torchrun follower rank: rank 0 reports
            return 0
        res = check_run.run_check(pool, args.impl, args)
    report.out(report.summary(res.results + res.fault_results, res.seconds))
    if args.json:
        report.write_json(args.json, {"command": "check", **check_run.outcome_json(res)})
    return 0 if res.passed else 1
