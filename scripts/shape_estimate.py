"""How good is `check --shape`'s up-front estimate? Run a few shapes end to end and print estimate
vs measured.

    python scripts/shape_estimate.py            # three shapes, ~5 minutes on 2 cores
    python scripts/shape_estimate.py --quick    # one small shape

The estimate (harness.checks.shape) models each run as its work (batch x heads_q x max(head_dim, 32)
x L^2) times fixed flop counts for the ring and the oracle, over this machine's measured one-thread
matmul rates and the cores the ranks use, times SLACK. Measured: the check's own wall time (growth
check and basics), the ranks' start excluded (the estimate does not count it). Output:
docs/benchmarks.md, figure 8.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [
    ("b1,hq8,hkv2,d64,L2048,W4", "fp16"),
    ("b2,hq4,hkv1,d128,L1024,W4", "bf16"),
    ("b1,hq4,hkv1,d64,L4096,W8", "bf16"),
]


def main() -> int:
    from harness.checks.check import check
    from harness.checks.options import CheckOptions
    from harness.checks.report import Reporter
    from harness.checks.stages import shape as shape_stage
    from harness.impls import registry

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    caps = registry.resolve("reference").capabilities
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(
        f"{'shape':<28} {'dtype':<5} {'runs':>4} {'estimate s':>10} {'measured s':>10} "
        f"{'measured / estimate':>20}"
    )
    with tempfile.TemporaryDirectory(prefix="rh-shape-") as tmp:
        for spec, dtype in shapes:
            opts = CheckOptions(shape=spec, dtype=dtype, save_dir=tmp, shape_budget=7200)
            plan, est = shape_stage.plan(opts, caps)
            res = check(opts, Reporter(io.StringIO()))
            measured = sum(v for k, v in res.stage_seconds.items() if k != "ranks start")
            print(
                f"{spec:<28} {dtype:<5} {len(plan.runs):>4} {est.seconds:>10.0f} "
                f"{measured:>10.0f} "
                f"{measured / est.seconds:>20.2f}   passed: {res.passed}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
