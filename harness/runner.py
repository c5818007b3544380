"""Run one case end to end: the ranks compute, then (unless cached) each computes its share of the
oracle (`oracle_mode` "ranks", the default; "local": this process computes it while the ranks run), then
the case is judged (`harness.judging.verdicts.judge`) and gets exactly one verdict.

This is the one step every check, search and diagnosis goes through: case -> ranks -> judging ->
`CaseResult`. A case with benign faults first runs fault-free (cached), so judging can demand that
the faults left the results bit-identical.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from harness.case import Case
from harness.judging import oracle
from harness.judging.verdicts import case_expected, judge
from harness.result import CaseResult, Verdict

if TYPE_CHECKING:
    from harness.ranks.protocol import Pool

ORACLE_MODES = ("ranks", "local")  # who computes the oracle: each rank its own share, or this process
_ORACLE_MODE = {"mode": "ranks"}
ORACLE_FLOPS_FLOOR = 2e8  # flop/s a rank reaches at worst: 1/50 of one core's float64 rate here (~1e10): the deadline
ORACLE_DEADLINE_MIN_S = 120.0


@contextlib.contextmanager
def oracle_mode(mode: str) -> Iterator[None]:
    """Run the cases of a block with the oracle computed by `mode` ("ranks" or "local")."""
    if mode not in ORACLE_MODES:
        from harness.errors import HarnessError

        raise HarnessError(f"unknown oracle {mode!r}; expected one of {', '.join(ORACLE_MODES)}")
    saved = _ORACLE_MODE["mode"]
    _ORACLE_MODE["mode"] = mode
    try:
        yield
    finally:
        _ORACLE_MODE["mode"] = saved


# flops per query x key x head x dim of one pass of a share, float64 and base together, 2 per product
# (harness.ranks.reference): rows, 6 float64 + 7 base products (26), keys, 4 + 4 (16); with room for the
# elementwise work
ORACLE_PASS_FLOPS = {"rows": 32.0, "keys": 20.0}


def oracle_deadline(case: Case, oracle_pass: str = "rows") -> float:
    """Seconds the ranks get for one pass of their oracle shares: the pass's float64 and base work for the
    largest share (its positions against every position) at ORACLE_FLOPS_FLOOR, never under
    ORACLE_DEADLINE_MIN_S."""
    local = max(case.seq_lens) if case.seq_lens else 0
    flops = ORACLE_PASS_FLOPS[oracle_pass] * case.batch * case.heads_q * case.head_dim * local * case.total_len
    return max(ORACLE_DEADLINE_MIN_S, flops / ORACLE_FLOPS_FLOOR)


def ring_completed(case: Case, reply) -> bool:
    """Every rank of the case's ring returned its tensors (so the case will be judged against the oracle)."""
    if reply.hung or reply.dead:
        return False
    ring = range(case.group_offset, case.group_offset + case.world_size)
    return all(reply.replies.get(r, {}).get("status") == "ok" for r in ring)


def oracle_from_ranks(case: Case, pool: Pool) -> float:
    """Have the ring's ranks compute the case's oracle shares (two passes: rows, then keys with every row's
    statistics gathered here), assemble and cache them; the slowest share's seconds on its rank."""
    ref, base, seconds = oracle.two_passes(
        case.total_len, case.world_size, case.scale,
        lambda: pool.oracle(case, oracle_deadline(case, "rows"), "rows"),
        lambda stats: pool.oracle(case, oracle_deadline(case, "keys"), "keys", stats))
    oracle.store(case, (ref, base))
    return seconds


_BASELINES: dict[tuple[str, str], dict] = {}
_BASELINES_MAX = 64


@functools.lru_cache(maxsize=64)
def needs_whole_world(impl: str) -> bool:
    """True for implementations that declare they cannot run inside a subgroup (their ring must be
    global ranks 0..W-1, so the pool is sized exactly W). Unresolvable names say False: the worker
    reports the real error."""
    from harness.impls import registry

    try:
        return not registry.resolve(impl, allow_import=False).capabilities.subgroups
    except Exception:
        return False


def oracle_threads(busy_ranks: int) -> int:
    """Torch threads for the parent's oracle and judge, whose rank processes (`busy_ranks`) compute
    or sit ready: the cores they leave, at least 1. More threads than free cores spin-wait (measured
    on 2 busy cores, 4 ranks: oracle 10x slower at 7x the parent's CPU time, judge 10-30x slower)."""
    return max(1, (os.cpu_count() or 1) - busy_ranks)


def baseline_for(case: Case, pool: Pool, impl: str, allow_import: bool = False) -> dict | None:
    """The fault-free run of a case whose faults must not change results: {verdict, hashes}; cached."""
    if not case.faults or case_expected(case) != Verdict.PASS:
        return None
    plain = case.replace(faults=())
    key = (impl, plain.key())
    if key not in _BASELINES:
        r = run_case(plain, pool, impl, allow_import=allow_import, leak=False)
        if len(_BASELINES) >= _BASELINES_MAX:
            _BASELINES.pop(next(iter(_BASELINES)))
        _BASELINES[key] = {"verdict": r.verdict, "hashes": r.hashes, "wall_s": r.timings.get("wall_s", 0.0),
                           "timings": r.timings}
    return _BASELINES[key]


LARGE_CASE_TOKENS = 8192  # below this every case fits; above it the memory estimate is checked first


def check_memory(case: Case, mode: str | None = None) -> None:
    """Refuse, before any rank starts, a case this machine cannot hold (issue #21): one line with the estimate
    (ranks with tiled blocks and their oracle shares, or the parent's whole oracle under `local`) instead of a
    rank killed mid-run."""
    if case.total_len < LARGE_CASE_TOKENS:
        return
    from harness.errors import HarnessError
    from harness.ranks import oom

    est = oom.estimate(case, oracle=mode or _ORACLE_MODE["mode"])
    if not est.fits:
        raise HarnessError(f"{case.summary()}: too large for this machine: {est.words()}")


def run_case(case: Case, pool: Pool, impl: str | None = None, *, allow_import: bool = False,
             leak: bool = True, keep_shards: bool = False) -> CaseResult:
    """Run `case` on the pool (implementation `impl` or the case's own) and judge it; with
    `keep_shards` the result also holds every rank's output tensors (for localisation probes). The
    oracle is computed as `oracle_mode` says (default: by the ranks, after their run)."""
    name = impl or case.impl
    mode = _ORACLE_MODE["mode"]
    check_memory(case, mode)
    baseline = baseline_for(case, pool, name, allow_import) if case.faults else None
    t_submit = time.perf_counter()
    ticket = pool.submit(case, name, allow_import=allow_import, leak=leak, whole_world=needs_whole_world(name))
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(oracle_threads(case.world_size))
    oracle_s, ranks_oracle_s = 0.0, 0.0
    try:
        if mode == "local":
            oracle.references(case)  # the oracle overlaps with the ranks' work
            oracle_s = time.perf_counter() - t0
        reply = pool.collect(ticket)
        t_collect = time.perf_counter()
        if mode == "ranks" and not oracle.cached(case) and ring_completed(case, reply):
            ranks_oracle_s = oracle_from_ranks(case, pool)
            oracle_s = time.perf_counter() - t_collect
        t_judge = time.perf_counter()
        res = judge(case, name, reply, oracle_s, keep_shards, baseline)
    finally:
        torch.set_num_threads(threads)
    local_s = oracle_s if mode == "local" else 0.0
    res.timings.update(submit_s=t0 - t_submit, collect_s=t_collect - t0 - local_s,
                       judge_s=time.perf_counter() - t_judge, oracle_share_s=ranks_oracle_s)  # for the benchmarks
    return res
