"""Measure (issue #19): the battery stage's wall time with and without the repeat check, interleaved
(medians of 3), and the share of the default check's wall time the repeat check costs.

    python scripts/measure_repeat_cost.py
"""

import statistics
import time

from harness import CheckOptions
from harness.checks.check import run_check
from harness.checks.report import ListReporter
from harness.ranks.pool import RankPool

times = {True: [], False: []}
with RankPool(8) as pool:
    run_check(pool, CheckOptions(max_examples=0, fault_stage=()), reporter=ListReporter())  # warm
    for _ in range(3):
        for rep in (True, False):
            t0 = time.perf_counter()
            run_check(
                pool,
                CheckOptions(max_examples=0, fault_stage=(), repeat=rep),
                reporter=ListReporter(),
            )
            times[rep].append(time.perf_counter() - t0)
b_on, b_off = statistics.median(times[True]), statistics.median(times[False])
print(
    f"battery stage: repeat on {b_on:.1f} s, off {b_off:.1f} s (medians of 3, interleaved): "
    f"repeat adds {b_on - b_off:.1f} s"
)
# the default check's wall time (ci profile: battery + fault stage + 45 s property budget + shrink)
t0 = time.perf_counter()
with RankPool(8) as pool:
    res = run_check(pool, CheckOptions(), reporter=ListReporter())
wall = time.perf_counter() - t0
print(f"default check wall {wall:.1f} s; repeat share {(b_on - b_off) / wall:.3f} of it")
