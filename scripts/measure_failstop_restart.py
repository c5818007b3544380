"""Measure (issue #17): how long a W=4 case takes to end when one rank raises 0.5 s in, and how long
the next case takes after a hang, with and without standby workers (RankPool(spare=True)).

    python scripts/measure_failstop_restart.py
"""

from __future__ import annotations

import time

from harness.case import make_case
from harness.ranks.pool import RankPool
from harness.runner import run_case


def main() -> None:
    c = make_case(world_size=4, total_len=24, mask={"kind": "causal"}, deadline_s=60.0)
    with RankPool(4) as pool:
        run_case(c, pool)
        t0 = time.monotonic()
        r = run_case(c, pool, "tests.helpers.impls:raise_on_rank1", allow_import=True)
        print(f"raise on rank 1 at 0.5 s: {r.verdict} after {time.monotonic() - t0:.2f} s; {r.detail[:160]}")
        t0 = time.monotonic()
        print(f"next case: {run_case(c, pool).verdict} after {time.monotonic() - t0:.2f} s")
    hang = c.replace(deadline_s=5.0)
    for spare in (False, True):
        with RankPool(4, spare=spare) as pool:
            run_case(hang, pool)
            time.sleep(4 if spare else 0)  # let the standby set import torch
            t0 = time.monotonic()
            r = run_case(hang, pool, "tests.helpers.impls:hang_on_rank1", allow_import=True)
            t1 = time.monotonic()
            r2 = run_case(hang, pool)
            print(f"spare={spare}: hang verdict {r.verdict} after {t1 - t0:.1f} s (deadline 5 s); next case "
                  f"{r2.verdict} after {time.monotonic() - t1:.1f} s (restart included)")


if __name__ == "__main__":
    main()
