"""Figure 11: where a small case's time goes, per phase and per process (issue #55).

The reference's default battery runs on one warm pool, each case under both oracle paths in
turn: "ranks" (each rank computes its share after the ring's run: two more round trips) and
"auto" (the default: a small case's oracle computed here while the ranks run; see
`harness.oracle.mode`). Per case it records the wall time, the parent's phases (submit, waiting
for the ranks, the oracle's round trips, judging), each rank's phases (inputs, forward, backward,
leak run, packing the reply) and the CPU seconds of the parent and of the ranks. Its one target:
the default path is not the slower in wall time. #55's targets compare this code with the last
release's, which one process cannot run (`scripts/compare_check_wall.py`, docs/benchmarks.md
section 13).
"""

from __future__ import annotations

import time

from harness.bench.timing import Figure, Target, fmt, load_line, median, proc_cpu_s, self_cpu_s
from harness.oracle import cache
from harness.oracle.mode import oracle_mode
from harness.ranks.pool import RankPool
from harness.runner import run_case
from harness.search.battery import battery_pool_size, default_battery

PATHS = ("ranks", "auto")
PARENT = ("submit_s", "collect_s", "oracle_s", "judge_s")
RANK = ("inputs_s", "forward_s", "backward_s", "leak_s", "pack_s")


def _one(pool: RankPool, case, path: str) -> dict[str, float]:
    """One case on `path`, its oracle not cached: wall, CPU and phase seconds."""
    cache.clear()
    pids = pool.pids()
    cpu0 = self_cpu_s(), sum(proc_cpu_s(p) for p in pids)
    t0 = time.perf_counter()
    with oracle_mode(path):
        r = run_case(case, pool)
    got = {"wall_s": time.perf_counter() - t0, "verdict": r.verdict}
    got["parent_cpu_s"] = self_cpu_s() - cpu0[0]
    got["ranks_cpu_s"] = sum(proc_cpu_s(p) for p in pids) - cpu0[1]
    for k in PARENT:
        got[k] = float(r.timings.get(k, 0.0))
    ranks = [v for k, v in r.timings.items() if k.startswith("rank") and isinstance(v, dict)]
    for k in RANK:
        got[k] = max((float(t.get(k, 0.0)) for t in ranks), default=0.0)
    return got


def measure(cases: list, rounds: int = 1) -> dict[str, list[dict]]:
    """Every case on both paths, alternating which goes first, on one pool."""
    rows: dict[str, list[dict]] = {p: [] for p in PATHS}
    with RankPool(battery_pool_size(cases)) as pool:
        _one(pool, cases[0], "ranks")
        for i in range(rounds * len(cases)):
            case = cases[i % len(cases)]
            order = PATHS if i % 2 == 0 else PATHS[::-1]
            for p in order:
                rows[p].append(_one(pool, case, p))
    return rows


def _line(name: str, rows: list[dict]) -> str:
    def ms(k: str) -> str:
        return fmt(1000 * median([r[k] for r in rows]))

    parent = ", ".join(f"{k[:-2]} {ms(k)}" for k in PARENT)
    rank = ", ".join(f"{k[:-2]} {ms(k)}" for k in RANK)
    return (
        f"{name:6s} per case (median ms): wall {ms('wall_s')}; CPU parent {ms('parent_cpu_s')} + "
        f"ranks {ms('ranks_cpu_s')}; parent: {parent}; slowest rank: {rank}"
    )


def run(quick: bool = False) -> Figure:
    cases = default_battery(4)
    cases = cases[:24] if quick else cases
    fig = Figure("case_cost", f"where a small case's time goes ({len(cases)} battery cases, W<=8)")
    rows = measure(cases)
    for p in PATHS:
        fig.lines.append(_line(p, rows[p]))
    verdicts = {p: sorted({r["verdict"] for r in rows[p]}) for p in PATHS}
    fig.lines.append(f"verdicts: {verdicts}")
    fig.lines.append(load_line())

    def cpu(p: str) -> float:
        return sum(r["parent_cpu_s"] + r["ranks_cpu_s"] for r in rows[p])

    def wall(p: str) -> float:
        return sum(r["wall_s"] for r in rows[p])

    fig.lines.append(
        f"auto / ranks: harness CPU per case {fmt(cpu(PATHS[1]) / cpu(PATHS[0]))} (the oracle's "
        "two paths, not #55's comparison)"
    )
    ratio = wall(PATHS[1]) / wall(PATHS[0])
    fig.targets = [
        Target("wall per case, auto / ranks (the default is not slower)", ratio, "<=", 1.0)
    ]
    fig.data = {p: rows[p] for p in PATHS}
    return fig
