"""Figure 4: the reference ring's forward + backward time at W=4 against an all-gather baseline and
single-process attention, the cost of a straggler rank, and how much communication the ring hides.

Every variant runs on the same warm pool, in rotating order, `reps` times; a run's time is the
slowest rank's forward + backward as the rank measured it (no leak run, no judging in it). The
oracle of each case is computed once in a warm-up round, so it never competes with a timed run.
"""

from __future__ import annotations

import os

from harness.bench.pool_vs_spawn import rank_compute_s
from harness.bench.timing import Figure, Target, fmt, interleaved, load_line, median
from harness.case import Case, make_case
from harness.faults.schema import make_fault
from harness.impls import registry
from harness.ranks.pool import RankPool
from harness.runner import run_case
from ring_impl.masks import MaskSpec

WORLD = 4
STRAGGLER = 4.0  # the slow rank computes this many times slower
IMPLS = {
    "ring": "reference",
    "all-gather": "harness.bench.allgather:impl",
    "ring, no transfers": "harness.bench.variants:no_transfers",
    "ring, transfers only": "harness.bench.variants:transfers_only",
}


def speed_case(total: int, world_size: int = WORLD) -> Case:
    """The timed case: zigzag causal (balanced), h4 d64 fp32, equal shards."""
    return make_case(
        world_size=world_size,
        total_len=total,
        layout="zigzag",
        mask=MaskSpec("causal"),
        heads_q=4,
        heads_kv=4,
        head_dim=64,
        seed=3,
        deadline_s=600.0,
    )


def _timer(pool: RankPool, case: Case, impl: str, verdicts: dict[str, list[str]], name: str):
    def once() -> float:
        r = run_case(case, pool, impl, allow_import=registry.is_module_path(impl), leak=False)
        verdicts.setdefault(name, []).append(r.verdict)
        return rank_compute_s(r)

    return once


def run(quick: bool = False) -> Figure:
    """Measure the figure; `quick` uses a short sequence and one round (smoke test)."""
    total, reps = (512, 1) if quick else (4096, 5)
    case = speed_case(total)
    straggler = case.replace(faults=(make_fault("straggler", rank=1, factor=STRAGGLER),))
    verdicts: dict[str, list[str]] = {}
    with RankPool(WORLD) as pool:
        pool.start()
        fns = {name: _timer(pool, case, impl, verdicts, name) for name, impl in IMPLS.items()}
        fns["single process (W=1)"] = _timer(
            pool, speed_case(total, 1), "reference", verdicts, "single"
        )
        fns[f"ring, rank 1 x{STRAGGLER:g} slower"] = _timer(
            pool, straggler, "reference", verdicts, "straggler"
        )
        # warm-up: first calls, the oracles, the straggler's fault-free baseline
        interleaved(fns, 1)
        verdicts.clear()
        times = interleaved(fns, reps)
    t = {k: median(v) for k, v in times.items()}
    ring, ag = t["ring"], t["all-gather"]
    nocomm, comm = t["ring, no transfers"], t["ring, transfers only"]
    slow = t[f"ring, rank 1 x{STRAGGLER:g} slower"]
    hidden = (nocomm + comm - ring) / comm if comm > 0 else float("nan")
    fig = Figure(
        "speed",
        f"reference ring forward+backward, W={WORLD}, L={total} (zigzag causal "
        "h4 d64 fp32), "
        f"median of {reps} interleaved rounds, slowest rank's time",
    )
    for k, v in t.items():
        fig.lines.append(
            f"{k:<26} {fmt(v):>7} s   x{fmt(v / ring):<6} of the ring   "
            f"[{fmt(min(times[k]))}-{fmt(max(times[k]))} s over the rounds]"
        )
    fig.lines.append(
        f"single process / ring = x{fmt(t['single process (W=1)'] / ring)} ({WORLD} "
        "ranks of 1 thread "
        f"on {os.cpu_count()} cores against 1 process of 1 thread; equal total work)"
    )
    fig.lines.append(
        f"straggler: one rank x{STRAGGLER:g} slower at compute -> whole ring "
        f"x{fmt(slow / ring)} slower"
    )
    fig.lines.append(
        f"overlap: transfers alone {fmt(comm)} s, compute alone {fmt(nocomm)} s, "
        f"together {fmt(ring)} s: "
        f"{fmt(100 * max(0.0, min(1.0, hidden)))}% of the transfer time hidden "
        "(exposed "
        f"{fmt(ring - nocomm)} s; differences inside the rounds' spread are noise)"
    )
    fig.lines.append(
        "verdicts (the variants are wrong on purpose): "
        + ", ".join(f"{k} {sorted(set(v))}" for k, v in verdicts.items())
    )
    fig.lines.append(load_line())
    fig.targets = [Target("ring / all-gather time", ring / ag, "<=", 1.5)]
    fig.data = {
        "times": times,
        "medians": t,
        "hidden_fraction": hidden,
        "straggler_slowdown": slow / ring,
        "verdicts": verdicts,
    }
    return fig
