"""Measure (issue #17) how fast the harness ends a case that cannot finish, and what a hanging ring
costs a whole default check:

- a W=4 case where rank 1 raises 0.5 s in: time from the raise to the fail-stop verdict;
- a W=4 case where rank 1 hangs (deadline 5 s): time to the hang verdict, then the next case's time
  (the restart), with and without standby workers (RankPool(spare=True));
- `ring-harness check --impl tests.helpers.impls:hang_on_rank1 --deadline 5` end to end (its wall
  time and last line), unless --no-check.

    python scripts/measure_failstop_restart.py [--no-check]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from harness.case import make_case
from harness.ranks.pool import RankPool
from harness.runner import run_case

RAISE_AFTER_S = 0.5  # tests.helpers.impls._raise_on_rank1 sleeps this long before raising


def cases() -> None:
    c = make_case(world_size=4, total_len=24, mask={"kind": "causal"}, deadline_s=60.0)
    with RankPool(4) as pool:
        run_case(c, pool)
        t0 = time.monotonic()
        r = run_case(c, pool, "tests.helpers.impls:raise_on_rank1", allow_import=True)
        dt = time.monotonic() - t0
        print(
            f"raise on rank 1 at {RAISE_AFTER_S} s: {r.verdict} after {dt:.2f} s, "
            f"{dt - RAISE_AFTER_S:.2f} s after the raise; {r.detail[:160]}"
        )
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
            print(
                f"spare={spare}: hang verdict {r.verdict} after {t1 - t0:.1f} s (deadline 5 s); "
                "next case "
                f"{r2.verdict} after {time.monotonic() - t1:.1f} s (restart included)"
            )


def whole_check() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "harness",
            "check",
            "--impl",
            "tests.helpers.impls:hang_on_rank1",
            "--deadline",
            "5",
            "--save-dir",
            os.path.join(tmp, "failures"),
        ]
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        dt = time.monotonic() - t0
        lines = p.stdout.strip().splitlines()
        saved = (
            len(os.listdir(os.path.join(tmp, "failures")))
            if os.path.isdir(os.path.join(tmp, "failures"))
            else 0
        )
    print(
        f"default check of a ring hanging on rank 1 at --deadline 5: exit {p.returncode} after "
        f"{dt:.0f} s "
        f"(target 300 s), {saved} file(s) saved"
    )
    print(f"    last line: {lines[-1] if lines else p.stderr.strip()[-300:]}")


if __name__ == "__main__":
    cases()
    if "--no-check" not in sys.argv[1:]:
        whole_check()
