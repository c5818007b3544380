"""Calibrate the verdicts on correct implementations (issue #10): the default check in the nightly
profile (battery, fault stage, growth check, then a property-based search of --time-budget seconds) for
each implementation and seed, one run at a time; prints one table row per run (cases per stage,
failures, why it stopped, the growth figure) and then, per implementation, the worst passing ratio
(error / allowed) per dtype and tensor over every stage of every seed.

    python scripts/calibrate.py --impls reference,flash-ring,torch-ring,torch-ring-alltoall --seeds 1,2 \\
        --time-budget 300 --log-dir /tmp/calibration

Each run's full check output goes to LOG_DIR/IMPL-seedS.log; failing cases to LOG_DIR/failures-IMPL-S/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness import CheckOptions
from harness.checks.check import check
from harness.checks.kill_matrix import worst_ratios
from harness.checks.report import Reporter
from harness.result import TENSORS


def _worst_growth(res) -> str:
    g = res.growth
    if g is None or not g.cases:
        return "-" if g is None else f"skipped ({g.skipped})"
    cells = [c.worst for c in g.cases if c.worst]
    if not cells:
        return "no figure"
    w, t, x = max(cells, key=lambda c: c[2])
    return f"x{x:.2f} ({t}, W{w})"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--impls", default="reference,flash-ring,torch-ring,torch-ring-alltoall")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--time-budget", type=float, default=300.0)
    p.add_argument("--log-dir", default="/tmp/calibration")
    a = p.parse_args()
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    worst: dict[str, dict[str, dict[str, float]]] = {}
    totals: dict[str, int] = {}
    print(
        "| implementation | seed | battery + fault stage + growth | property-based cases | "
        "failures | stop "
        "| growth worst | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for impl in a.impls.split(","):
        for seed in (int(s) for s in a.seeds.split(",")):
            opts = CheckOptions(
                impl=impl,
                profile="nightly",
                seed=seed,
                time_budget=a.time_budget,
                save_dir=str(logs / f"failures-{impl}-{seed}"),
            )
            t0 = time.perf_counter()
            with open(logs / f"{impl}-seed{seed}.log", "w", encoding="utf-8") as fh:
                res = check(opts, reporter=Reporter(fh))
            n_growth = sum(len(c.results) for c in res.growth.cases) if res.growth else 0
            n_prop = res.prop.examples if res.prop else 0
            totals[impl] = totals.get(impl, 0) + n_prop
            fails = len(res.failures) + len(res.findings)
            stop = res.prop.stop if res.prop else res.stopped or "-"
            print(
                f"| {impl} | {seed} | {len(res.results)} + {len(res.fault_results)} + {n_growth} "
                f"| {n_prop} | "
                f"{fails} | {stop} | {_worst_growth(res)} | {time.perf_counter() - t0:.0f} |",
                flush=True,
            )
            for dt, per in worst_ratios(res).items():
                cell = worst.setdefault(impl, {}).setdefault(dt, {})
                for t, x in per.items():
                    cell[t] = max(cell.get(t, 0.0), x)
    print()
    print("Property-based cases, all seeds: " + "; ".join(f"{k} {v:,}" for k, v in totals.items()))
    print()
    print("| implementation | dtype | " + " | ".join(TENSORS) + " |")
    print("|---|---|" + "---|" * len(TENSORS))
    for impl, per_dt in worst.items():
        for dt in ("fp32", "fp16", "bf16"):
            if dt in per_dt:
                cells = " | ".join(
                    f"{per_dt[dt][t]:.3f}" if t in per_dt[dt] else "-" for t in TENSORS
                )
                print(f"| {impl} | {dt} | {cells} |")


if __name__ == "__main__":
    main()
