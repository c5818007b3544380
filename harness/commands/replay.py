"""`ring-harness replay CASE.yaml`: re-run a saved case, say whether its recorded verdict reproduces
and whether the output hashes match the record bit for bit. Exit 0 pass, 1 fail, 2 bad input."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness import case as case_mod
from harness.checks import property as fuzz_report
from harness.checks import report
from harness.checks.replay import Replay, replay
from harness.diagnose import localise
from harness.errors import HarnessError
from harness.ranks.launch import open_pool
from harness.search import fuzz


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", metavar="CASE.yaml", help="a saved case file")
    p.add_argument("--impl", default=None,
                   help="run under this implementation instead of the case's (a built-in name or package.module:attr; "
                        "a case file may only name one, so give module paths here)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write error heatmaps (PNG) here if the case fails")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: gloo")
    p.add_argument("--json", metavar="FILE", help="write the replay result here")


def hash_line(rp: Replay, deterministic: bool) -> str:
    """Whether the output hashes match the record, in words."""
    if rp.recorded_verdict is None:
        return "hashes: not compared (no record for this implementation)"
    if not rp.hashes_compared:
        return "hashes: none recorded to compare"
    if not rp.hash_mismatches:
        return f"hashes: all {rp.hashes_compared} output shards match the record bit for bit"
    why = rp.hash_note or ("" if deterministic else "the implementation declares itself non-deterministic")
    head = f"hashes: {len(rp.hash_mismatches)} of {rp.hashes_compared} output shards DIFFER from the record"
    return head + (f" ({why})" if why else "") + "\n" + "\n".join(f"        {m}" for m in rp.hash_mismatches[:8])


def run(args: argparse.Namespace) -> int:
    path = Path(args.case)
    case, data = case_mod.load(path)
    impl = args.impl or case.impl
    if args.impl is None and ":" in case.impl:
        raise HarnessError(f"{path} names implementation {case.impl!r}, a module path; a case file may only name "
                           f"one, so give it on the command line: --impl {case.impl}")
    if args.plot:
        fuzz_report.check_options(argparse.Namespace(max_examples=None, time_budget=None, seed=None, plot=args.plot))
    allow_import = ":" in impl
    recorded = data.get("result") or {}
    _, version = fuzz.impl_info(impl, allow_import)
    deterministic = _deterministic(impl, allow_import)
    report.out(f"replay {path}: impl {impl}" + (f" (recorded for {case.impl})" if impl != case.impl else ""))
    if recorded:
        v = recorded.get("versions", {})
        report.out(f"recorded: {recorded.get('verdict')} (torch {v.get('torch')}, ring-harness "
                   f"{v.get('ring-harness')}, impl {v.get('impl')}, backend {recorded.get('backend')})")
    with open_pool("local", args.backend, case.pool_size) as pool:
        rp = replay(path, pool, impl if args.impl else None, allow_import=allow_import)
        r = rp.result
        report.out(report.header())
        report.out(report.row(1, 1, r))
        for line in report.details(r):
            report.out(line)
        loc = None
        if not r.passed and r.checks:
            loc = localise.localise(r, pool, probes=bool(args.plot))
            for line in localise.lines(loc):
                report.out(line)
        if rp.recorded_verdict is None:
            report.out(f"verdict: {r.verdict}")
        elif rp.verdict_reproduced:
            report.out(f"verdict: {r.verdict}: reproduces the recorded verdict")
        else:
            report.out(f"verdict: {r.verdict}: does NOT reproduce the recorded verdict {rp.recorded_verdict}")
        report.out(hash_line(rp, deterministic))
        if args.plot and loc is not None and loc.blocks:
            for p in fuzz_report.plot(loc, args.plot, path.stem):
                report.out(f"heatmap {p}")
    if args.json:
        report.write_json(args.json, {"command": "replay", "case": str(path), "impl": impl, "impl_version": version,
                                      "recorded_verdict": rp.recorded_verdict, "verdict": r.verdict,
                                      "reproduced": rp.verdict_reproduced, "hashes_compared": rp.hashes_compared,
                                      "hash_mismatches": rp.hash_mismatches, "result": r.to_dict(),
                                      "localisation": None if loc is None else localise.summary(loc)})
    return 0 if r.passed else 1


def _deterministic(impl: str, allow_import: bool) -> bool:
    try:
        from harness.impls import registry

        return bool(registry.resolve(impl, allow_import=allow_import).deterministic)
    except (ImportError, HarnessError):
        return True
