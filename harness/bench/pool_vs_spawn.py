"""Figure 1: the persistent rank pool against spawning fresh ranks for every case.

The same small cases (W=4, total length <= 256) run (a) on one warm RankPool, (b) on a fresh
RankPool per case, its workers fresh interpreters, (c) under torch.multiprocessing.spawn per case
(rendezvous, run, tear down: what per-test multi-process harnesses do) and (d) on a fresh RankPool
per case whose workers are forked from the zygote (what a fresh-rank confirmation costs now). Blocks
of pool cases are interleaved with the others. Per-case overhead = the case's wall time minus its
in-rank compute (the slowest rank's forward + backward, leak run included); every case is judged the
same way on every path.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch

from harness.bench.timing import Figure, Target, fmt, load_line, median, proc_cpu_s, self_cpu_s
from harness.case import Case, make_case, to_dict
from harness.judging.judge import judge
from harness.oracle import cache
from harness.oracle.mode import oracle_threads
from harness.ranks import zygote
from harness.ranks.pool import PoolReply, RankPool
from harness.result import CaseResult
from harness.runner import run_case
from ring_impl.masks import MaskSpec

WORLD = 4
LENGTHS = (64, 128, 192, 256)
MASKS = (
    MaskSpec("causal"),
    MaskSpec("none"),
    MaskSpec("window", window=24),
    MaskSpec("document", doc_starts=(0, 29, 70)),
)
LAYOUTS = ("zigzag", "contiguous", "striped")
DTYPES = ("fp32", "bf16", "fp32", "fp16")


def small_cases(n: int, seed0: int = 1) -> list[Case]:
    """`n` small W=4 cases cycling lengths 64-256, every mask, layout and dtype, GQA on odd ones."""
    out = []
    for i in range(n):
        gqa = i % 2 == 1
        out.append(
            make_case(
                world_size=WORLD,
                total_len=LENGTHS[i % len(LENGTHS)],
                layout=LAYOUTS[i % 3],
                mask=MASKS[i % len(MASKS)],
                dtype=DTYPES[i % len(DTYPES)],
                heads_q=4 if gqa else 2,
                heads_kv=2,
                head_dim=32 if gqa else 16,
                seed=seed0 + i,
                deadline_s=120.0,
            )
        )
    return out


def rank_compute_s(r: CaseResult) -> float:
    """The slowest rank's in-rank compute: forward + backward, plus the leak run's."""
    per = [
        v.get("forward_s", 0.0) + v.get("backward_s", 0.0) + v.get("leak_s", 0.0)
        for k, v in r.timings.items()
        if k.startswith("rank") and isinstance(v, dict)
    ]
    return max(per) if per else 0.0


# -- (c) torch.multiprocessing.spawn per case ------------------------------------------------------
def _spawn_rank(rank: int, size: int, workdir: str, msg: dict) -> None:
    """One spawned rank: rendezvous, run the case exactly as a pool worker would, write the
    reply."""
    import torch.distributed as dist

    from harness.ranks.execute import handle_case
    from harness.ranks.groups import Groups

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(workdir, "store"), size),
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        reply = handle_case(msg, rank, Groups("gloo"), torch.device("cpu"), {}, workdir)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(workdir, f"reply-{rank}.pkl"), "wb") as f:
        pickle.dump(reply, f, protocol=pickle.HIGHEST_PROTOCOL)


def spawn_case(case: Case) -> CaseResult:
    """Run and judge one case on freshly spawned ranks (torch.multiprocessing.spawn); none outlive
    it."""
    import torch.multiprocessing as mp

    workdir = tempfile.mkdtemp(prefix="ring-bench-spawn-")
    msg = {
        "op": "run",
        "case": to_dict(case),
        "impl": case.impl,
        "allow_import": False,
        "leak": True,
        "case_id": 1,
    }
    t0 = time.monotonic()
    ctx = mp.start_processes(
        _spawn_rank,
        args=(case.pool_size, workdir, msg),
        nprocs=case.pool_size,
        join=False,
        start_method="spawn",
    )
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(oracle_threads(case.world_size))
        try:
            o0 = time.perf_counter()
            pair = cache.outputs(case)  # overlapped with the ranks, as run_case does
            oracle_s = time.perf_counter() - o0
        finally:
            torch.set_num_threads(threads)
        deadline = t0 + case.deadline_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"spawned ranks did not finish within {case.deadline_s:g} s")
        replies = {}
        for r in range(case.pool_size):
            with open(os.path.join(workdir, f"reply-{r}.pkl"), "rb") as f:
                replies[r] = pickle.load(f)
        reply = PoolReply(replies=replies, wall_s=time.monotonic() - t0, restarted=True)
        return judge(case, case.impl, reply, pair, oracle_s)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
        shutil.rmtree(workdir, ignore_errors=True)


def fresh_pool_case(case: Case, fork: bool = False) -> CaseResult:
    """Run and judge one case on a RankPool started for it and closed after it: its workers fresh
    interpreters (`fork=False`), or forked from this process's zygote (harness.ranks.zygote)."""
    saved = os.environ.get(zygote.FORK_ENV)
    os.environ[zygote.FORK_ENV] = "1" if fork else "0"
    try:
        with RankPool(case.pool_size) as pool:
            return run_case(case, pool)
    finally:
        if saved is None:
            os.environ.pop(zygote.FORK_ENV, None)
        else:
            os.environ[zygote.FORK_ENV] = saved


def forked_pool_case(case: Case) -> CaseResult:
    return fresh_pool_case(case, fork=True)


def _timed(fn, case: Case) -> tuple[float, CaseResult]:
    t0 = time.perf_counter()
    r = fn(case)
    return time.perf_counter() - t0, r


# the four ways to run a case, in the figure's order
PATHS = ("pool", "fresh-pool", "mp.spawn", "forked")


@dataclass
class _Tally:
    """Per path: the wall time and overhead of each case; all verdicts; the warm pool's wall and
    CPU time."""

    walls: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PATHS})
    over: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PATHS})
    verdicts: dict[str, int] = field(default_factory=dict)
    pool_wall: float = 0.0
    pool_cpu: float = 0.0

    def add(self, path: str, wall: float, r: CaseResult) -> None:
        """Count one case run on `path`."""
        self.walls[path].append(wall)
        self.over[path].append(wall - rank_compute_s(r))
        self.verdicts[r.verdict] = self.verdicts.get(r.verdict, 0) + 1


def _pool_block(pool: RankPool, cases: list[Case], tally: _Tally) -> None:
    """A block of cases on the warm pool, with its wall and CPU time (parent + ranks)."""
    c0 = self_cpu_s() + sum(proc_cpu_s(p) for p in pool.pids())
    t0 = time.perf_counter()
    for c in cases:
        wall, r = _timed(lambda c: run_case(c, pool), c)
        tally.add("pool", wall, r)
    tally.pool_wall += time.perf_counter() - t0
    tally.pool_cpu += self_cpu_s() + sum(proc_cpu_s(p) for p in pool.pids()) - c0


def _spawn_round(i: int, case: Case, tally: _Tally) -> None:
    """One case on each fresh-ranks path, in an order that flips every round."""
    order = (
        ("fresh-pool", fresh_pool_case),
        ("mp.spawn", spawn_case),
        ("forked", forked_pool_case),
    )
    for name, fn in order if i % 2 == 0 else order[::-1]:
        wall, r = _timed(fn, case)
        tally.add(name, wall, r)


def _measure(cases: list[Case], spawn_cases: list[Case], rounds: int) -> _Tally:
    """`rounds` blocks of pool cases, each followed by one case on every fresh-ranks path."""
    tally = _Tally()
    block = len(cases) // rounds
    with RankPool(WORLD) as pool:
        pool.start()
        for c in small_cases(2, seed0=20_000):  # warm-up: first calls, lazily created groups
            run_case(c, pool)
        # warm-up: the zygote's own start is paid once
        forked_pool_case(small_cases(1, seed0=30_000)[0])
        for i in range(rounds):
            _pool_block(pool, cases[i * block : (i + 1) * block], tally)
            _spawn_round(i, spawn_cases[i], tally)
    return tally


def run(quick: bool = False) -> Figure:
    """Measure the figure; `quick` runs a handful of cases (smoke test)."""
    n_pool, rounds = (8, 1) if quick else (80, 4)
    cases = small_cases(n_pool)
    # other seeds: no oracle cache hits across paths
    spawn_cases = small_cases(rounds, seed0=10_000)
    tally = _measure(cases, spawn_cases, rounds)
    walls, over, verdicts = tally.walls, tally.over, tally.verdicts
    n_done = n_pool // rounds * rounds
    med = {k: median(v) for k, v in over.items()}
    # the cheaper spawn: the harder bound
    spawn_name = min(("fresh-pool", "mp.spawn"), key=lambda k: med[k])
    ratio = med["pool"] / med[spawn_name]
    rate = n_done / tally.pool_wall
    cpu_case = tally.pool_cpu / n_done
    cores = os.cpu_count() or 1
    fig = Figure(
        "pool_vs_spawn",
        f"persistent pool vs fresh ranks per case ({n_done} pool cases, "
        f"{len(spawn_cases)} per spawn path; W={WORLD}, "
        f"L={'/'.join(map(str, LENGTHS))})",
    )
    for k in walls:
        fig.lines.append(
            f"{k:<10} per case: wall {fmt(median(walls[k]) * 1e3)} ms, overhead (wall "
            "- in-rank "
            f"compute) {fmt(med[k] * 1e3)} ms  [median of {len(walls[k])}]"
        )
    fig.lines.append(
        f"pool: {fmt(rate)} cases/s measured; CPU (parent + ranks) "
        f"{fmt(cpu_case * 1e3)} ms/case "
        f"-> {fmt(cores / cpu_case)} cases/s if the {cores} cores were the harness's "
        "alone"
    )
    fig.lines.append(f"verdicts: {verdicts}")
    fig.lines.append(load_line())
    fig.targets = [
        Target(f"pool / {spawn_name} per-case overhead", ratio, "<=", 0.05),
        Target("small cases/s on the pool", rate, ">=", 10.0),
        Target(
            f"forked / {spawn_name} per-case overhead (fresh ranks forked from a zygote)",
            med["forked"] / med[spawn_name],
            "<=",
            0.25,
        ),
    ]
    fig.data = {
        "walls": walls,
        "overheads": over,
        "pool_cases_per_s": rate,
        "cpu_per_case_s": cpu_case,
        "verdicts": verdicts,
        "load": os.getloadavg(),
    }
    return fig
