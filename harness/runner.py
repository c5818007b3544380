"""Run one case end to end: the ranks compute while this process computes the oracle, then the
case is judged (`harness.judging.verdicts.judge`) and gets exactly one verdict.

This is the one step every check, search and diagnosis goes through: case -> ranks -> judging ->
`CaseResult`. A case with benign faults first runs fault-free (cached), so judging can demand that
the faults left the results bit-identical.
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING

import torch

from harness.case import Case
from harness.judging import oracle
from harness.judging.verdicts import case_expected, judge
from harness.result import CaseResult, Verdict

if TYPE_CHECKING:
    from harness.ranks.protocol import Pool

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


def check_memory(case: Case) -> None:
    """Refuse, before any rank starts, a case this machine cannot hold (issue #21): one line with the estimate
    (ranks with tiled blocks + the parent's float64 oracle) instead of a rank killed mid-run."""
    if case.total_len < LARGE_CASE_TOKENS:
        return
    from harness.errors import HarnessError
    from harness.ranks import oom

    est = oom.estimate(case)
    if not est.fits:
        raise HarnessError(f"{case.summary()}: too large for this machine: {est.words()}")


def run_case(case: Case, pool: Pool, impl: str | None = None, *, allow_import: bool = False,
             leak: bool = True, keep_shards: bool = False) -> CaseResult:
    """Run `case` on the pool (implementation `impl` or the case's own) and judge it; with
    `keep_shards` the result also holds every rank's output tensors (for localisation probes)."""
    name = impl or case.impl
    check_memory(case)
    baseline = baseline_for(case, pool, name, allow_import) if case.faults else None
    t_submit = time.perf_counter()
    ticket = pool.submit(case, name, allow_import=allow_import, leak=leak, whole_world=needs_whole_world(name))
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(oracle_threads(case.world_size))
    try:
        oracle.references(case)  # the oracle overlaps with the ranks' work
        oracle_s = time.perf_counter() - t0
        reply = pool.collect(ticket)
        t_judge = time.perf_counter()
        res = judge(case, name, reply, oracle_s, keep_shards, baseline)
    finally:
        torch.set_num_threads(threads)
    res.timings.update(submit_s=t0 - t_submit, collect_s=t_judge - t0 - oracle_s,
                       judge_s=time.perf_counter() - t_judge)  # parent-side phases, for the benchmarks
    return res
