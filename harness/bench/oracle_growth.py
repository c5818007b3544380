"""Figure 5: how the oracle's cost grows with sequence length, its memory at 16k tokens, and the
longest case the CPU harness judges within one minute.

The oracle (exact float64 outputs + same-dtype base, forward and backward, blockwise over queries)
runs in a fresh process per length, single-threaded as in `run_case` on 2 cores; its peak RSS is
the kernel's high-water mark reset at the start (ru_maxrss would include the parent's RSS, which
Linux carries across fork + exec). The one-minute figure runs whole cases (W=4 ranks, oracle, leak
run, judge) at doubling lengths, then refines between the last one under and the first one over.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from harness.bench.memory import Peak, _rss
from harness.bench.timing import Figure, Target, fmt, in_fresh_process, load_line
from harness.case import Case, make_case
from harness.dtypes import TORCH_DTYPES
from harness.ranks.pool import RankPool
from harness.result import Verdict
from harness.runner import run_case
from ring_impl.masks import MaskSpec

GIB = 1 << 30
WORLD = 4
BUDGET_S = 60.0
MEMORY_LIMIT_GIB = 24.0


def growth_case(total: int) -> Case:
    """zigzag causal, h4 d64 fp32 (the speed figure's shape), W=4."""
    return make_case(
        world_size=WORLD,
        total_len=total,
        layout="zigzag",
        mask=MaskSpec("causal"),
        heads_q=4,
        heads_kv=4,
        head_dim=64,
        seed=5,
        deadline_s=3600.0,
    )


def _child(total: int) -> dict:
    """In a fresh process: the oracle of one case, its time and peak memory."""
    import torch

    from harness import inputs
    from harness.oracle.assemble import attention_pair

    torch.set_num_threads(1)
    case = growth_case(total)
    small = inputs.make_global(growth_case(64))
    # first calls
    attention_pair(*(small[n] for n in inputs.NAMES), case.mask, case.scale, torch.float32)
    g = inputs.make_global(case)
    args = (g["q"], g["k"], g["v"], g["dout"], case.mask, case.scale)
    before = _rss()
    t0 = time.perf_counter()
    with Peak() as peak:
        attention_pair(*args, TORCH_DTYPES[case.dtype])
    seconds = time.perf_counter() - t0
    return {
        "total": total,
        "seconds": seconds,
        "peak": peak.peak,
        "above_baseline": peak.peak - before,
    }


def oracle_cost(total: int, timeout_s: float = 1800.0) -> dict:
    """Time and peak memory of the oracle for `total` tokens, in a fresh process."""
    return in_fresh_process(
        "harness.bench.oracle_growth",
        ["--total", str(total)],
        f"oracle at {total} tokens",
        timeout_s,
    )


def _judge_time(pool: RankPool, total: int) -> float:
    """Wall seconds of one whole case of `total` tokens on the pool (it must pass)."""
    t0 = time.perf_counter()
    r = run_case(growth_case(total), pool)
    if r.verdict != Verdict.PASS:
        raise RuntimeError(f"growth case at {total} tokens: {r.verdict} {r.detail}")
    return time.perf_counter() - t0


def _round(n: float) -> int:
    """Down to a multiple of 2W (zigzag chunks of equal size)."""
    return max(2 * WORLD, int(n) // (2 * WORLD) * (2 * WORLD))


def largest_in_budget(
    pool: RankPool, start: int, budget_s: float, refine: int = 3
) -> tuple[int, float, list[tuple[int, float]]]:
    """(length, seconds, all runs): the longest case judged within `budget_s`, found by doubling
    until a case takes longer, then `refine` power-law guesses between the last length under and
    the first over the budget."""
    runs: list[tuple[int, float]] = []
    n = start
    while True:
        runs.append((n, _judge_time(pool, n)))
        if runs[-1][1] > budget_s or len(runs) > 12:
            break
        n *= 2
    if len(runs) == 1:  # even the first length is over budget
        return 0, float("nan"), runs
    lo, hi = runs[-2], runs[-1]
    for _ in range(refine):
        p = math.log(hi[1] / lo[1]) / math.log(hi[0] / lo[0]) if hi[1] > lo[1] else 2.0
        guess = min(_round(lo[0] * (budget_s / lo[1]) ** (1.0 / p)), _round(hi[0] - 1))
        if guess <= lo[0]:
            break
        runs.append((guess, _judge_time(pool, guess)))
        lo, hi = (runs[-1], hi) if runs[-1][1] <= budget_s else (lo, runs[-1])
    return lo[0], lo[1], runs


def growth(a: dict, b: dict) -> float:
    """Exponent p of time ~ n^p between two measured lengths."""
    return math.log(b["seconds"] / a["seconds"]) / math.log(b["total"] / a["total"])


def run(quick: bool = False) -> Figure:
    """Measure the figure; `quick` uses short lengths and a 1.5 s budget (smoke test)."""
    lengths = (256, 512) if quick else (1024, 2048, 4096, 8192, 16384)
    budget = 1.5 if quick else BUDGET_S
    costs = [oracle_cost(n) for n in lengths]
    with RankPool(WORLD) as pool:
        pool.start()
        run_case(growth_case(64), pool)  # warm-up
        best, best_s, runs = largest_in_budget(
            pool, 256 if quick else 2048, budget, refine=1 if quick else 3
        )
    fig = Figure(
        "oracle_growth",
        "oracle cost vs total length (float64 reference + fp32 base, "
        "forward+backward, "
        "zigzag causal h4 d64, 1 thread, fresh process per length)",
    )
    fig.lines.append(
        f"{'tokens':>7} {'seconds':>9} {'growth exp.':>11} {'peak RSS GiB':>13} "
        f"{'above start GiB':>16}"
    )
    prev = None
    for c in costs:
        exp = "" if prev is None else fmt(growth(prev, c))
        fig.lines.append(
            f"{c['total']:>7} {fmt(c['seconds']):>9} {exp:>11} "
            f"{fmt(c['peak'] / GIB):>13} "
            f"{fmt(c['above_baseline'] / GIB):>16}"
        )
        prev = c
    fig.lines.append(
        f"whole cases (W={WORLD} ranks + oracle + leak run + judge): "
        + ", ".join(f"{n} tok {fmt(t)} s" for n, t in runs)
    )
    fig.lines.append(f"longest judged within {fmt(budget)} s: {best} tokens ({fmt(best_s)} s)")
    fig.lines.append(load_line())
    top = costs[-1]
    fig.targets = [
        Target(
            f"oracle peak RSS at {top['total']} tokens",
            top["peak"] / GIB,
            "<=",
            MEMORY_LIMIT_GIB,
            " GiB",
        )
    ]
    fig.data = {"oracle": costs, "runs": runs, "largest_in_budget": best, "budget_s": budget}
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="harness.bench.oracle_growth")
    p.add_argument("--total", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    a = p.parse_args(argv)
    from harness.ranks.worker import _die_with_parent

    _die_with_parent(a.parent)
    print(json.dumps(_child(a.total)))


if __name__ == "__main__":
    main()
