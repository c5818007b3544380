"""How much of a default check is the ring's own run on the ranks, and how much the harness's.

    python scripts/ring_share.py [--impl reference] [--runs 1]
    PYTHONPATH=/path/to/other/tree python scripts/ring_share.py   # another commit's harness

It runs the default check in this process and, for every judged case, takes the slowest rank's
forward + backward + leak run, as the ranks timed them (`forward_s`, `backward_s`, `leak_s`).
Their sum is the ring's share of the wall time: the ring's Python and kernels, its communication,
and the interposer's work on each op. The rest is the harness's own: drawing, shards, the oracle
where it does not overlap, judging, the pool's messages. Issue #55 measures both side by side.
"""

from __future__ import annotations

import argparse
import io
import time

import harness.runner as runner
from harness.checks.check import check
from harness.checks.options import CheckOptions
from harness.checks.report import Reporter


def _ring_seconds(reply) -> float:
    """The slowest ring rank's own forward, backward and leak run for one case."""
    times = [rep.get("timings", {}) for rep in getattr(reply, "replies", {}).values() if rep]
    keys = ("forward_s", "backward_s", "leak_s")
    return max((sum(t.get(k, 0.0) for k in keys) for t in times), default=0.0)


def measure(impl: str) -> tuple[float, float, int, bool]:
    """(wall s, the ring's s, cases judged, passed) of one default check of `impl`."""
    judged = {"ring": 0.0, "cases": 0}
    judge = runner.judge

    def counted(case, name, reply, *args, **kwargs):
        judged["ring"] += _ring_seconds(reply)
        judged["cases"] += 1
        return judge(case, name, reply, *args, **kwargs)

    runner.judge = counted
    try:
        t0 = time.perf_counter()
        res = check(CheckOptions(impl=impl), Reporter(io.StringIO()))
        wall = time.perf_counter() - t0
    finally:
        runner.judge = judge
    return wall, judged["ring"], judged["cases"], res.passed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="reference")
    ap.add_argument("--runs", type=int, default=1)
    a = ap.parse_args()
    for i in range(1, a.runs + 1):
        wall, ring, cases, passed = measure(a.impl)
        print(
            f"{a.impl} run {i}: check {wall:.1f} s wall, {cases} cases judged; the ring's own run "
            f"{ring:.1f} s ({ring / wall:.0%}); the harness's own {wall - ring:.1f} s; "
            f"passed: {passed}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
