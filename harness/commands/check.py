"""`ring-harness check`: the fixed battery against one implementation on a pool of ranks."""

from __future__ import annotations

import argparse
import time

from harness import fuzz_report, registry, report
from harness.battery import battery_pool_size, default_battery
from harness.capabilities import adapt, format_matrix, matrix, unsupported
from harness.faults import command as fault_command
from harness.launch import open_pool
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
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="default: gloo for the local pool; nccl under torchrun when CUDA is available")
    p.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                   help="local: a pool of worker processes on this host; torchrun: the ranks torchrun started")
    fuzz_report.add_arguments(p)
    fault_command.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from harness.errors import HarnessError

    if not 1 <= args.world_size <= 64:
        raise HarnessError(f"--world-size must be in 1..64, got {args.world_size}")
    if args.faults:
        return fault_command.run(args)
    fuzz_report.check_options(args)
    cases = default_battery(args.world_size, args.dtype, impl=args.impl)
    if args.deadline is not None:
        cases = [c.replace(deadline_s=args.deadline) for c in cases]
    allow_import = ":" in args.impl
    caps = registry.resolve(args.impl, allow_import=allow_import).capabilities
    probes = _probes(caps, cases)
    cases = [c if not unsupported(caps, c) else adapt(caps, c) for c in cases]
    cases = list({c.key(): c for c in cases if c is not None}.values())
    results = []
    start = time.perf_counter()
    with open_pool(args.launcher, args.backend, battery_pool_size(cases + probes)) as pool:
        if pool is None:  # a torchrun follower rank: rank 0 reports
            return 0
        too_big = [c for c in cases if c.pool_size > pool.size]
        if too_big:
            report.out(f"skipping {len(too_big)} case(s) that need more than the {pool.size} ranks started")
            cases = [c for c in cases if c.pool_size <= pool.size]
        report.out(f"ring-harness check: {len(cases)} cases, impl {args.impl}, {pool.backend} ranks "
                   f"({args.launcher}, {pool.size} ranks)")
        report.out(report.header())
        for i, c in enumerate(cases, 1):
            r = run_case(c, pool, args.impl, allow_import=allow_import)
            results.append(r)
            report.out(report.row(i, len(cases), r))
            for line in report.details(r):
                report.out(line)
            if not r.passed:
                path = save_result(r, args.save_dir, backend=pool.backend)
                report.out(f"        saved {path}")
        probe_results = []
        if probes:
            report.out(f"probing {len(probes)} case(s) with features {args.impl} does not declare:")
            for i, c in enumerate(probes, 1):
                r = run_case(c, pool, args.impl, allow_import=allow_import)
                probe_results.append(r)
                report.out(report.row(i, len(probes), r) + "  [" + ", ".join(unsupported(caps, c)) + "]")
                if r.verdict not in ("pass", "fail-stop"):
                    path = save_result(r, args.save_dir, backend=pool.backend,
                                       note=f"undeclared feature probe: {', '.join(unsupported(caps, c))}")
                    report.out(f"        finding saved {path}")
        for line in format_matrix(matrix(caps, results, probe_results)):
            report.out(line)
        prop = fuzz_report.run_property(args, pool, args.impl, allow_import, pool.backend,
                                        [r for r in results if not r.passed])
    seconds = time.perf_counter() - start
    report.out(report.summary(results, seconds))
    if args.json:
        report.write_json(args.json, {"command": "check", "impl": args.impl, "seconds": seconds,
                                      "results": [r.to_dict() for r in results],
                                      "property": fuzz_report.outcome_json(prop)})
    findings = [r for r in probe_results if r.verdict not in ("pass", "fail-stop")]
    return 0 if all(r.passed for r in results) and prop.passed and not findings else 1


def _probes(caps, cases: list) -> list:
    """One probe case per undeclared feature the battery exercises (the first case using it)."""
    seen, out = set(), []
    for c in cases:
        missing = tuple(unsupported(caps, c))
        if missing and not set(missing) <= seen:
            seen.update(missing)
            out.append(c.replace(deadline_s=min(c.deadline_s, 30.0)))
    return out
