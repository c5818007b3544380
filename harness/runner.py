"""Run one case end to end: the ranks compute, then the oracle, then judging gives one verdict.

Every check, search and diagnosis goes through this step: case -> ranks -> judging -> `CaseResult`.
The oracle's outputs come from the cache, or from whoever `harness.oracle.mode` names. They reach
`harness.judging.judge.judge` as arguments. A case with benign faults first runs fault-free, so
judging can demand that the faults left the results bit-identical.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import torch

from harness.case import Case
from harness.errors import HarnessError
from harness.impls import registry
from harness.judging.judge import judge, needs_oracle
from harness.judging.verdicts import case_expected
from harness.oracle import cache
from harness.oracle.assemble import Pair
from harness.oracle.mode import PARENT_MODES, mode_for, oracle_from_ranks, oracle_threads
from harness.result import CaseResult, Verdict

if TYPE_CHECKING:
    from harness.ranks.protocol import Pool


def ring_completed(case: Case, reply) -> bool:
    """Whether every rank of the case's ring returned its tensors.

    Such a case is judged against the oracle.
    """
    if reply.hung or reply.dead:
        return False
    ring = range(case.group_offset, case.group_offset + case.world_size)
    return all(reply.replies.get(r, {}).get("status") == "ok" for r in ring)


_BASELINES: dict[tuple[str, str], dict] = {}
_BASELINES_MAX = 64


@functools.lru_cache(maxsize=64)
def needs_whole_world(impl: str, allow_import: bool = False) -> bool:
    """Whether an implementation declares that it cannot run inside a subgroup.

    Its ring must then be global ranks 0..W-1, so the pool is sized exactly W. A user's ring, a
    module path, is read when `allow_import`. A name that does not resolve says False, and the
    worker reports the real error.
    """
    try:
        return not registry.resolve(impl, allow_import=allow_import).capabilities.subgroups
    except Exception:
        return False


def submit(
    pool: Pool,
    case: Case,
    impl: str,
    *,
    allow_import: bool = False,
    leak: bool = True,
    profile: bool = False,
) -> object:
    """Start `case` on the pool's ranks, whole-world when the ring declares it must be.

    Every caller goes through here, so a user's ring (`allow_import`) is read the same way.
    """
    whole = needs_whole_world(impl, allow_import)
    return pool.submit(
        case, impl, allow_import=allow_import, leak=leak, whole_world=whole, profile=profile
    )


def baseline_for(case: Case, pool: Pool, impl: str, allow_import: bool = False) -> dict | None:
    """The cached fault-free run of a case whose faults must not change results.

    It is {verdict, hashes}, or None when the faults may change the results.
    """
    if not case.faults or case_expected(case) != Verdict.PASS:
        return None
    plain = case.replace(faults=())
    key = (impl, plain.key())
    if key not in _BASELINES:
        r = run_case(plain, pool, impl, allow_import=allow_import, leak=False)
        if len(_BASELINES) >= _BASELINES_MAX:
            _BASELINES.pop(next(iter(_BASELINES)))
        _BASELINES[key] = {
            "verdict": r.verdict,
            "hashes": r.hashes,
            "wall_s": r.timings.get("wall_s", 0.0),
            "timings": r.timings,
        }
    return _BASELINES[key]


def check_memory(case: Case, mode: str | None = None) -> None:
    """Refuse a case this machine cannot hold, before any rank starts.

    The refusal is one line with the estimate, instead of a rank killed mid-run. The estimate counts
    every dimension: batch, heads, head dims and lengths. It counts the ranks with tiled blocks and
    their oracle shares; under `local`, the parent's whole oracle instead. A case whose own tensors
    are small fits whatever the load, so only the larger ones read the free memory.
    docs/long-sequences.md has the figures.
    """
    from harness.ranks import oom

    mode = mode_for(case, mode=mode)
    if oom.estimate(case, available=0, oracle=mode).work < oom.SMALL_WORK:
        return
    est = oom.estimate(case, oracle=mode)
    if not est.fits:
        raise HarnessError(f"{case.summary()}: too large for this machine: {est.words()}")


def run_case(
    case: Case,
    pool: Pool,
    impl: str | None = None,
    *,
    allow_import: bool = False,
    leak: bool = True,
    keep_shards: bool = False,
) -> CaseResult:
    """Run `case` on the pool and judge it.

    `impl` names the implementation, by default the case's own. With `keep_shards`, the result also
    holds every rank's output tensors, for the localisation probes. `harness.oracle.mode` says who
    computes the oracle: the ranks, after their run, or this process, while the ranks run (a small
    case on CPU ranks by default, every case under `--oracle local`).
    """
    name = impl or case.impl
    mode = mode_for(case, pool)
    check_memory(case, mode)
    baseline = baseline_for(case, pool, name, allow_import) if case.faults else None
    t_submit = time.perf_counter()
    ticket = submit(pool, case, name, allow_import=allow_import, leak=leak)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(oracle_threads(case.world_size))
    oracle_s, ranks_oracle_s = 0.0, 0.0
    pair: Pair | None = None
    try:
        if mode in PARENT_MODES:
            # The oracle overlaps with the ranks' work.
            pair = cache.outputs(case, mode)
            oracle_s = time.perf_counter() - t0
        reply = pool.collect(ticket)
        t_collect = time.perf_counter()
        if mode == "ranks":
            pair = cache.lookup(case)
            if pair is None and ring_completed(case, reply):
                exact, base, ranks_oracle_s = oracle_from_ranks(case, pool)
                pair = (exact, base)
                cache.store(case, pair)
                oracle_s = time.perf_counter() - t_collect
        t_judge = time.perf_counter()
        if pair is None and needs_oracle(case, reply):
            # the ring did not complete but its tensors are judged: this process computes the oracle
            pair = cache.outputs(case, mode)
        res = judge(case, name, reply, pair, oracle_s, keep_shards, baseline)
    finally:
        torch.set_num_threads(threads)
    local_s = oracle_s if mode in PARENT_MODES else 0.0
    res.timings.update(
        submit_s=t0 - t_submit,
        collect_s=t_collect - t0 - local_s,
        # for the benchmarks
        judge_s=time.perf_counter() - t_judge,
        oracle_share_s=ranks_oracle_s,
    )
    return res
