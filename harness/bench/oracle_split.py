"""Figure 6 (issue #12): the oracle computed by the ranks (each its own query rows) against the
oracle computed in one process, measured side by side in one run on this machine.

(a) The medium cases (W=4, L=2048, h8 d64, 4 masks, fp32/bf16, GQA: the overhead figure's), each run
    whole under both oracles: wall time against the ranks' own forward + backward (incl. the leak
    run), the oracle's part of the wall, and the ranks-oracle's wall / ranks' compute against the
    target 4.
(b) Oracle wall time against tokens (zigzag causal h4 d64 fp32): the local oracle (one process, the
    one torch thread `run_case` gives it while W ranks are busy on this machine's cores) and the
    ranks' oracle at W = 1, 2, 4 (each rank one thread; `harness.oracle.mode.oracle_from_ranks`,
    incl. sending the shares back and assembling them), medians of interleaved rounds. On C cores
    the ranks' oracle should take ~1/min(W, C) of W=1's time.
(c) A paper estimate, not a measurement, for 8 GPUs at 64k and 128k tokens: the oracle's float64 and
    base products counted per (query, visible key, head, dim) (FLOPS_PER_QKHD), the measured CPU
    rate from (b), and a published fp64 peak (H100 SXM, 67 TFLOP/s FP64 Tensor Core) at an assumed
    GPU_EFFICIENCY.
(d) One share's memory against W: in a fresh process per W, the peak resident bytes above the
    process's baseline of share 0's rows pass and of its keys pass (given row statistics of the
    right shape, plus their bytes: memory does not depend on their values), at W = 2, 4, 8 for one
    length where every W cuts its zigzag chunks into tiles of the same side. A share holds its own
    positions (~n/W) plus one tile's workspace (the same at every W): memory = C + A/W, so C =
    peak(8) - (peak(4) - peak(8)) and the part that scales falls from W=2 to W=8 by ~4 (the rows and
    keys passes hold different tensors: the larger of the two is taken).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from harness.bench.memory import Peak, _rss
from harness.bench.overhead import medium_cases
from harness.bench.pool_vs_spawn import rank_compute_s
from harness.bench.timing import Figure, Target, fmt, in_fresh_process, interleaved, load_line
from harness.case import Case, make_case
from harness.oracle import assemble, cache
from harness.oracle.mode import oracle_from_ranks, oracle_mode, oracle_threads
from harness.ranks import oom
from harness.ranks.pool import RankPool
from harness.runner import run_case
from ring_impl.masks import MaskSpec

WORLD = 4
TARGET_RATIO = 4.0  # medium case: wall <= 4 x the ranks' own forward + backward
# products per (query, visible key, query head, head dim), 2 flops each (harness.oracle.shares):
# float64, rows pass q.k x 2, p.v, p.|v| (term scale), dout.v, ds.k, keys pass q.k, dout.v, ds^T.q,
# p^T.dout = 10; the base (float32 or the dtype), rows pass q.k x 3, dout.v x 2, p.v, ds.k, keys
# pass the same four = 11
FLOPS_PER_QKHD = 2 * (10 + 11)
GPU_FP64_PEAK = 67e12  # NVIDIA H100 SXM datasheet: FP64 Tensor Core, FLOP/s
# assumed fraction of that peak the oracle's batched einsums reach (an assumption)
GPU_EFFICIENCY = 0.5
ESTIMATE_GPUS = 8


def growth_case(total: int, world_size: int) -> Case:
    """zigzag causal, h4 d64 fp32 (the oracle growth figure's shape) on `world` ranks."""
    return make_case(
        world_size=world_size,
        total_len=total,
        layout="zigzag",
        mask=MaskSpec("causal"),
        heads_q=4,
        heads_kv=4,
        head_dim=64,
        seed=5,
        deadline_s=3600.0,
    )


def visible_products(case: Case) -> float:
    """(query, visible key, head, dim) products of the case's oracle (causal: n(n+1)/2 pairs)."""
    n = case.total_len
    pairs = n * (n + 1) / 2 if case.mask.is_causal else float(n * n)
    return pairs * case.batch * case.heads_q * case.head_dim


def _medium(pool: RankPool, cases: list[Case]) -> dict[str, list[dict[str, float]]]:
    rows: dict[str, list[dict[str, float]]] = {"ranks": [], "local": []}
    for c in cases:
        for mode in ("ranks", "local"):  # interleaved: load on the machine hits both alike
            cache.clear()
            with oracle_mode(mode):
                t0 = time.perf_counter()
                r = run_case(c, pool)
                wall = time.perf_counter() - t0
            fb = [
                v.get("forward_s", 0.0) + v.get("backward_s", 0.0)
                for k, v in r.timings.items()
                if k.startswith("rank") and isinstance(v, dict)
            ]
            rows[mode].append(
                {
                    "wall": wall,
                    "ranks": rank_compute_s(r),
                    "ranks_fb": max(fb, default=0.0),
                    "oracle": r.timings.get("oracle_s", 0.0),
                    "verdict_pass": float(r.passed),
                }
            )
    return rows


def _growth(
    pool: RankPool, lengths: tuple[int, ...], worlds: tuple[int, ...], reps: int
) -> dict[int, dict[str, float]]:
    """Per length, the medians of `reps` interleaved rounds (rotating order) of the local and W-rank
    oracles."""

    def on_ranks(n: int, w: int):
        def go() -> None:
            oracle_from_ranks(growth_case(n, w), pool)

        return go

    def local(n: int):
        def go() -> None:
            threads = torch.get_num_threads()
            torch.set_num_threads(oracle_threads(WORLD))
            try:
                assemble.local(growth_case(n, WORLD))
            finally:
                torch.set_num_threads(threads)

        return go

    pool.ensure(max(worlds))
    out: dict[int, dict[str, float]] = {}
    for n in lengths:
        fns = {f"W{w}": on_ranks(n, w) for w in worlds}
        fns["local"] = local(n)
        out[n] = {k: statistics.median(v) for k, v in interleaved(fns, reps).items()}
    return out


def _share_child(total: int, world_size: int) -> dict:
    """In a fresh process: peak bytes above its baseline of share 0's rows pass and keys pass
    (`total` tokens, `world` shares); the keys pass gets row statistics of the right shape (not the
    values: the other shares' rows passes are not run) and counts their bytes."""
    from harness.oracle import parts, shares, tiles

    torch.set_num_threads(1)
    # first calls: lazy imports, the allocator's arenas
    shares.share_rows(growth_case(64, world_size), 0)
    case = growth_case(total, world_size)
    shape = (case.batch, case.heads_q, total)
    stats = tuple(
        parts.RowStats(
            torch.zeros(shape, dtype=dt),
            torch.ones(shape, dtype=dt),
            torch.zeros(shape, dtype=dt),
            torch.zeros(shape, dtype=dt) if amp else None,
        )
        for dt, amp in ((torch.float64, True), (torch.float32, False))
    )
    stats_bytes = sum(
        t.numel() * t.element_size() for st in stats for t in vars(st).values() if t is not None
    )
    tiles.TRIM(0)
    before = _rss()
    with Peak() as p_rows:
        part = shares.share_rows(case, 0)
    del part
    tiles.TRIM(0)
    before_keys = _rss()
    with Peak() as p_keys:
        shares.share_keys(case, 0, stats)
    return {
        "total": total,
        "world": world_size,
        "rows": p_rows.peak - before,
        "keys": p_keys.peak - before_keys + stats_bytes,
    }


def share_memory(total: int, world_size: int, timeout_s: float = 1800.0) -> dict:
    """`_share_child` in a fresh process (its own baseline and high-water mark); as in the ring's
    memory figure, glibc maps every block over 64 KiB on its own and returns freed memory at once,
    so the resident peak is what the tensors alive at once need, not what the allocator happened to
    keep."""
    return in_fresh_process(
        "harness.bench.oracle_split",
        ["--share-memory", str(total), str(world_size)],
        f"share memory at {total} tokens, W={world_size}",
        timeout_s,
        {"MALLOC_MMAP_THRESHOLD_": str(1 << 16), "MALLOC_TRIM_THRESHOLD_": "0"},
    )


def _estimate_lines(rate: float) -> list[str]:
    lines = [
        f"paper estimate (not measured): {ESTIMATE_GPUS} GPUs, each its share, float64 at "
        f"{fmt(GPU_FP64_PEAK / 1e12)} TFLOP/s peak (H100 SXM FP64 Tensor Core) x "
        f"{GPU_EFFICIENCY:g} assumed "
        f"efficiency; this host's measured rate {fmt(rate / 1e9)} GFLOP/s per rank thread"
    ]
    for heads, dim in ((4, 64), (32, 128)):
        for n in (65536, 131072):
            c = make_case(
                world_size=ESTIMATE_GPUS,
                total_len=n,
                layout="zigzag",
                mask=MaskSpec("causal"),
                heads_q=heads,
                heads_kv=heads,
                head_dim=dim,
                dtype="bf16",
            )
            flops = FLOPS_PER_QKHD * visible_products(c)
            gpu_s = flops / (ESTIMATE_GPUS * GPU_FP64_PEAK * GPU_EFFICIENCY)
            cpu_s = flops / rate
            lines.append(
                f"  {n // 1024}k tokens h{heads} d{dim} causal: {fmt(flops / 1e12)} TFLOP "
                f"-> ~{fmt(gpu_s)} s "
                f"on {ESTIMATE_GPUS} GPUs (one thread of this host: ~{fmt(cpu_s / 3600)} "
                "h); memory per "
                f"share ~{fmt(oom.oracle_share_bytes(c) / (1 << 30))} GiB"
            )
    return lines


def run(quick: bool = False) -> Figure:
    """Measure the figure; `quick` runs two small medium cases and two short lengths (smoke
    test)."""
    n_cases, total = (2, 512) if quick else (4, 2048)
    lengths = (256, 512) if quick else (2048, 4096, 8192)
    worlds = (1, 2, 4)
    # 32k: zigzag chunks of 8192 / 4096 / 2048 tokens at W = 2 / 4 / 8, each cut into equal blocks
    # of 683 (the tile side at h4 is 724), so every W has the same tile workspace
    mem_n = 2048 if quick else 32768
    cores = os.cpu_count() or 1
    with RankPool(WORLD) as pool:
        pool.start()
        run_case(medium_cases(1, 256, seed0=99)[0], pool)  # warm-up
        medium = _medium(pool, medium_cases(n_cases, total))
        growth = _growth(pool, lengths, worlds, reps=1 if quick else 3)
    mem = {w: share_memory(mem_n, w) for w in (2, 4, 8)}
    fig = Figure("oracle_split", f"the oracle on the ranks vs in one process ({cores} cores)")
    ratio = _medium_rows(fig, medium, n_cases, total)
    _growth_rows(fig, growth, worlds, cores)
    big = max(growth)
    rate = FLOPS_PER_QKHD * visible_products(growth_case(big, 1)) / growth[big]["W1"]
    fig.lines += _estimate_lines(rate)
    scaled = _memory_rows(fig, mem, mem_n)
    fig.lines.append(load_line())
    w_top = max(worlds)
    speedup = statistics.median(row["W1"] / row[f"W{w_top}"] for row in growth.values())
    fig.targets = _targets(ratio["ranks"], speedup, w_top, cores, scaled, mem_n)
    fig.data = {
        "medium": medium,
        "growth": {str(k): v for k, v in growth.items()},
        "rate_flops": rate,
        "cores": cores,
        "share_memory": {str(w): m for w, m in mem.items()},
    }
    return fig


def _medium_rows(
    fig: Figure, medium: dict[str, list[dict[str, float]]], n_cases: int, total: int
) -> dict[str, float]:
    """Part (a) on `fig`: the medium cases' medians under each oracle.

    Returns each oracle's median of wall / ranks' compute.
    """
    med = {
        mode: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for mode, rows in medium.items()
    }
    ratio = {
        mode: statistics.median(r["wall"] / r["ranks"] for r in rows)
        for mode, rows in medium.items()
    }
    fig.lines.append(
        f"(a) {n_cases} medium cases (W={WORLD}, L={total}, h8 d64, 4 masks, "
        "fp32/bf16, GQA), median:"
    )
    for mode in ("local", "ranks"):
        m = med[mode]
        fig.lines.append(
            f"    oracle {mode:5s}: wall {fmt(m['wall'])} s, ranks' fwd+bwd "
            f"{fmt(m['ranks_fb'])} s "
            f"(+ leak run: {fmt(m['ranks'])} s), oracle {fmt(m['oracle'])} s; wall / "
            "ranks' compute "
            f"{fmt(ratio[mode])}"
        )
    return ratio


def _growth_rows(
    fig: Figure, growth: dict[int, dict[str, float]], worlds: tuple[int, ...], cores: int
) -> None:
    """Part (b) on `fig`: the oracle's wall time against tokens, local and on W ranks."""
    fig.lines.append(
        "(b) oracle wall (s) vs tokens, zigzag causal h4 d64 fp32, medians of "
        "interleaved rounds; local: "
        f"one process, {oracle_threads(WORLD)} thread; ranks: W ranks, one thread "
        f"each, on {cores} cores"
    )
    fig.lines.append(
        "    tokens   local "
        + "".join(f"    W={w}" for w in worlds)
        + "   local/W="
        + "/W=".join(str(w) for w in worlds)
    )
    for n, row in growth.items():
        fig.lines.append(
            f"    {n:6d} {fmt(row['local']):>7s} "
            + "".join(f" {fmt(row[f'W{w}']):>6s}" for w in worlds)
            + "   "
            + " ".join(fmt(row["local"] / row[f"W{w}"]) for w in worlds)
        )


def _memory_rows(fig: Figure, mem: dict[int, dict], mem_n: int) -> float:
    """Part (d) on `fig`: one share's peak memory against W, split as C + A / W.

    Returns how much the part beyond C falls from W=2 to W=8.
    """
    gib = 1 << 30
    peak = {w: max(m["rows"], m["keys"]) for w, m in mem.items()}
    work = peak[8] - (peak[4] - peak[8])  # C of C + A / W
    fig.lines.append(
        f"(d) one share's peak memory above a fresh process at {mem_n} tokens (zigzag "
        "causal h4 d64 fp32; "
        f"GiB): the tile workspace C = {fmt(work / gib)}"
    )
    for w, m in mem.items():
        fig.lines.append(
            f"    W={w}: rows pass {fmt(m['rows'] / gib)}, keys pass "
            f"{fmt(m['keys'] / gib)}; "
            f"beyond C {fmt((peak[w] - work) / gib)}"
        )
    return (peak[2] - work) / max(peak[8] - work, 1)


def _targets(
    ratio: float, speedup: float, w_top: int, cores: int, scaled: float, mem_n: int
) -> list[Target]:
    """The figure's three targets: the medium case's overhead, the speedup on W ranks, memory."""
    return [
        Target(
            "medium case wall / ranks' own compute (oracle on the ranks)",
            ratio,
            "<=",
            TARGET_RATIO,
        ),
        Target(
            f"oracle W=1 / W={w_top}, median over lengths (ideal min(W, cores) = "
            f"{min(w_top, cores)})",
            speedup,
            ">=",
            0.8 * min(w_top, cores),
        ),
        Target(
            f"one share's memory beyond the tile workspace at {mem_n} tokens, W=2 / W=8 (ideal 4)",
            scaled,
            ">=",
            3.0,
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="harness.bench.oracle_split")
    p.add_argument("--share-memory", type=int, nargs=2, metavar=("TOKENS", "W"), required=True)
    p.add_argument("--parent", type=int, required=True)
    a = p.parse_args(argv)
    from harness.ranks.worker import _die_with_parent

    _die_with_parent(a.parent)
    print(json.dumps(_share_child(*a.share_memory)))


if __name__ == "__main__":
    main()
