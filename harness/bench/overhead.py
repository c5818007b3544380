"""Figure 2: the harness's own share of a medium case's wall time.

Arithmetic is the implementation's forward + backward on the ranks (leak run included) and the
parent's float64 oracle, which overlap; the rest of the wall time (submitting, building shards,
hashing, pickling and gathering the shards, judging) is the harness's overhead:
    overhead = wall - max(slowest rank's forward + backward, oracle).
The gathered shards are also re-serialised here to show what pickling them costs.
"""

from __future__ import annotations

import pickle
import time

from harness.bench.pool_vs_spawn import rank_compute_s
from harness.bench.timing import Figure, Target, fmt, load_line, median
from harness.case import Case, make_case
from harness.ranks import wire
from harness.ranks.pool import RankPool
from harness.result import CaseResult
from harness.runner import run_case
from ring_impl.masks import MaskSpec

WORLD = 4


def medium_cases(n: int, total: int, seed0: int = 100) -> list[Case]:
    """`n` medium W=4 cases of `total` tokens: causal/window/document/none, fp32 and bf16, GQA."""
    masks = (
        MaskSpec("causal"),
        MaskSpec("window", window=total // 4),
        MaskSpec("none"),
        MaskSpec("document", doc_starts=(0, total // 3, total // 2 + 7)),
    )
    layouts = ("zigzag", "contiguous", "striped", "zigzag")
    out = []
    for i in range(n):
        out.append(
            make_case(
                world_size=WORLD,
                total_len=total,
                layout=layouts[i % 4],
                mask=masks[i % 4],
                dtype=("fp32", "bf16")[i % 2],
                heads_q=8,
                heads_kv=(8, 2)[i % 2],
                head_dim=64,
                seed=seed0 + i,
                deadline_s=600.0,
            )
        )
    return out


def _serialise_s(r: CaseResult) -> float:
    """Seconds to pickle and unpickle what the ranks sent back (shards, leak shards, hashes)."""
    replies = [{"tensors": s} for s in (r.shards or {}).values()]
    t0 = time.perf_counter()
    for rep in replies:
        pickle.loads(wire.dumps(rep))
    return time.perf_counter() - t0


def phases(r: CaseResult, wall: float) -> dict[str, float]:
    """Where one case's wall time went (seconds)."""
    ranks = [v for k, v in r.timings.items() if k.startswith("rank") and isinstance(v, dict)]
    compute = rank_compute_s(r)
    oracle = r.timings.get("oracle_s", 0.0)
    # the local oracle overlaps the ranks' work; the ranks' oracle follows it (issue #12)
    arithmetic = compute + oracle if r.timings.get("oracle_share_s", 0.0) else max(compute, oracle)
    return {
        "wall": wall,
        "rank_compute": compute,
        "oracle": oracle,
        "arithmetic": arithmetic,
        "overhead": wall - arithmetic,
        "submit": r.timings.get("submit_s", 0.0),
        "judge": r.timings.get("judge_s", 0.0),
        "rank_inputs": max((v.get("inputs_s", 0.0) for v in ranks), default=0.0),
        "rank_hash": max((v.get("pack_s", 0.0) for v in ranks), default=0.0),
        "serialise": _serialise_s(r),
    }


def run(quick: bool = False) -> Figure:
    """Measure the figure; `quick` runs two small-medium cases (smoke test)."""
    n, total = (2, 512) if quick else (8, 2048)
    cases = medium_cases(n, total)
    rows: list[dict[str, float]] = []
    verdicts: dict[str, int] = {}
    with RankPool(WORLD) as pool:
        pool.start()
        run_case(medium_cases(1, 256, seed0=99)[0], pool)  # warm-up
        for c in cases:
            t0 = time.perf_counter()
            r = run_case(c, pool, keep_shards=True)
            rows.append(phases(r, time.perf_counter() - t0))
            verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
    share = [x["overhead"] / x["wall"] for x in rows]
    med = {k: median([x[k] for x in rows]) for k in rows[0]}
    fig = Figure(
        "overhead",
        f"harness overhead vs arithmetic, {n} medium cases (W={WORLD}, "
        f"L={total}, "
        f"h8 d64, 4 masks, fp32/bf16, GQA)",
    )
    fig.lines.append(
        f"median per case: wall {fmt(med['wall'])} s = max(rank fwd+bwd incl. leak "
        "run "
        f"{fmt(med['rank_compute'])} s, oracle {fmt(med['oracle'])} s) + overhead "
        f"{fmt(med['overhead'] * 1e3)} ms"
    )
    fig.lines.append(
        f"overhead parts (median ms): submit {fmt(med['submit'] * 1e3)}, rank shard "
        "build "
        f"{fmt(med['rank_inputs'] * 1e3)}, rank hashing "
        f"{fmt(med['rank_hash'] * 1e3)}, "
        f"pickle+unpickle of the shards {fmt(med['serialise'] * 1e3)}, judge "
        f"{fmt(med['judge'] * 1e3)}"
    )
    fig.lines.append(f"verdicts: {verdicts}")
    fig.lines.append(load_line())
    fig.targets = [Target("overhead share of wall time", median(share), "<", 0.20)]
    fig.data = {"rows": rows, "share": share, "verdicts": verdicts}
    return fig
