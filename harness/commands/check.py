"""`ring-harness check`: the fixed battery against one implementation on a pool of ranks."""

from __future__ import annotations

import argparse
import time

from harness import report
from harness.battery import battery_pool_size, default_battery
from harness.pool import RankPool
from harness.record import save_result
from harness.runner import run_case


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", default="reference",
                   help="implementation: a built-in name (see `ring-harness impls`) or package.module:attr")
    p.add_argument("--world-size", type=int, default=4, help="main ring size of the battery (default 4)")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="run every case in this dtype")
    p.add_argument("--json", metavar="FILE", help="write machine-readable results here")
    p.add_argument("--save-dir", default="ring-harness-failures", metavar="DIR",
                   help="where failing cases are written as YAML (default ./ring-harness-failures)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS", help="per-case deadline")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")


def run(args: argparse.Namespace) -> int:
    from harness.errors import HarnessError

    if not 1 <= args.world_size <= 64:
        raise HarnessError(f"--world-size must be in 1..64, got {args.world_size}")
    cases = default_battery(args.world_size, args.dtype, impl=args.impl)
    if args.deadline is not None:
        cases = [c.replace(deadline_s=args.deadline) for c in cases]
    allow_import = ":" in args.impl
    results = []
    start = time.perf_counter()
    report.out(f"ring-harness check: {len(cases)} cases, impl {args.impl}, {args.backend} ranks "
               f"(pool of {battery_pool_size(cases)})")
    report.out(report.header())
    with RankPool(battery_pool_size(cases), backend=args.backend) as pool:
        for i, c in enumerate(cases, 1):
            r = run_case(c, pool, args.impl, allow_import=allow_import)
            results.append(r)
            report.out(report.row(i, len(cases), r))
            for line in report.details(r):
                report.out(line)
            if not r.passed:
                path = save_result(r, args.save_dir, backend=args.backend)
                report.out(f"        saved {path}")
    seconds = time.perf_counter() - start
    report.out(report.summary(results, seconds))
    if args.json:
        report.write_json(args.json, {"command": "check", "impl": args.impl, "seconds": seconds,
                                      "results": [r.to_dict() for r in results]})
    return 0 if all(r.passed for r in results) else 1
