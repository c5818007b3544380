"""What the gloo loop thread's batch policy (`harness/ranks/gloo_device.py`, #55) saves: the same
rings on pools whose loop threads run under the default policy and under SCHED_BATCH.

    python scripts/gloo_loop_policy.py [--cases 40] [--rounds 2] [--impl reference]

For W = 2, 4 and 8: `--cases` causal zigzag cases of 8 tokens a rank, bf16, on a fresh 8-rank pool
each way. Rounds alternate the two ways, so a drift of the host's load weighs on both. It prints
each way's median milliseconds a case and their ratio, and fails if a case does not pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from harness.case import make_case
from harness.ranks import gloo_device
from harness.ranks.pool import RankPool
from harness.runner import run_case
from ring_impl.masks import MaskSpec

WORLDS = (2, 4, 8)
WAYS = ("other", "batch")


def _per_case_ms(impl: str, way: str, cases: int) -> dict[int, float]:
    """Milliseconds a case for each W, on a fresh pool whose loop threads run `way`."""
    os.environ[gloo_device.LOOP_POLICY_ENV] = way
    out = {}
    with RankPool(8) as pool:
        for w in WORLDS:
            batch = [
                make_case(
                    world_size=w,
                    total_len=8 * w,
                    heads_q=2,
                    heads_kv=1,
                    head_dim=16,
                    layout="zigzag",
                    mask=MaskSpec("causal"),
                    dtype="bf16",
                    seed=s,
                    impl=impl,
                )
                for s in range(cases + 1)
            ]
            run_case(batch[0], pool)  # the group is made outside the timing
            t0 = time.perf_counter()
            for c in batch[1:]:
                res = run_case(c, pool)
                if not res.passed:
                    raise SystemExit(f"{c.summary()}: {res.verdict.value}: {res.detail}")
            out[w] = (time.perf_counter() - t0) / cases * 1000
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--impl", default="reference")
    a = ap.parse_args()
    ms: dict[str, dict[int, list[float]]] = {way: {w: [] for w in WORLDS} for way in WAYS}
    for i in range(a.rounds):
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:
            for w, t in _per_case_ms(a.impl, way, a.cases).items():
                ms[way][w].append(t)
    for w in WORLDS:
        base, batch = (statistics.median(ms[way][w]) for way in WAYS)
        print(
            f"{a.impl} W={w}: loop thread under the default policy {base:.1f} ms a case, "
            f"under SCHED_BATCH {batch:.1f} ms: x{batch / base:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
