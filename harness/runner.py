"""Run one case end to end: ranks compute on the pool while the parent computes the oracle, then
judge and give the run exactly one verdict."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import torch

from harness import inputs
from harness.case import Case
from harness.judging import oracle
from harness.judging.judge import LeakCheck, TensorCheck, check_leak, check_tensors
from harness.ranks.pool import PoolReply, RankPool

VERDICTS = ("pass", "silent-corruption", "fail-stop", "hang", "diverged", "invalid")
TORCH_DTYPES = inputs.TORCH_DTYPES


@dataclass
class CaseResult:
    """The outcome of one case: verdict, per-rank/per-tensor checks, errors, stacks, hashes, timings."""

    case: Case
    impl: str
    verdict: str
    detail: str = ""
    checks: list[TensorCheck] = field(default_factory=list)
    leak: LeakCheck | None = None
    errors: dict[int, str] = field(default_factory=dict)  # group rank -> one-line error
    hung: dict[int, str] = field(default_factory=dict)  # group rank -> stack
    dead: dict[int, str] = field(default_factory=dict)  # group rank -> how it died
    hashes: dict[int, dict[str, str]] = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    maps: dict[str, torch.Tensor] = field(default_factory=dict)  # tensor -> (batch, token, head) abs error
    shards: dict[int, dict[str, torch.Tensor]] | None = None  # group rank -> outputs, with keep_shards

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def worst(self, tensor: str) -> float | None:
        """Worst error ratio (error / allowed) of a tensor over all ranks; None if not checked."""
        r = [c.ratio for c in self.checks if c.tensor == tensor]
        return max(r) if r else None

    def failed_checks(self) -> list[TensorCheck]:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        from harness.case import to_dict

        return {
            "case": to_dict(self.case), "summary": self.case.summary(), "impl": self.impl,
            "verdict": self.verdict, "detail": self.detail,
            "worst_ratio": {t: self.worst(t) for t in ("out", "lse", "dq", "dk", "dv") if self.worst(t) is not None},
            "checks": [c.to_dict() for c in self.checks],
            "leak": None if self.leak is None else {"queries": self.leak.queries, "hidden_keys": self.leak.hidden_keys,
                                                    "leaks": self.leak.leaks, "passed": self.leak.passed},
            "errors": self.errors, "hung": self.hung, "dead": self.dead, "hashes": self.hashes,
            "timings": self.timings, **({"extra": self.extra} if self.extra else {}),
        }


MAP_LIMIT = 1 << 22  # error maps are kept when batch * tokens * heads is at most this

_ORACLE_CACHE: dict[str, tuple[oracle.Reference, oracle.Reference]] = {}
_ORACLE_CACHE_MAX = 8


def references(case: Case) -> tuple[oracle.Reference, oracle.Reference]:
    """(float64 reference, same-dtype base) for a case; cached because shrinking and replays
    re-run the same inputs under other implementations or faults."""
    key = case.replace(impl="-", faults=(), tolerance={}, deadline_s=1.0).key()
    if key not in _ORACLE_CACHE:
        g = inputs.make_global(case)
        args = (g["q"], g["k"], g["v"], g["dout"], case.mask, case.scale)
        ref = oracle.attention(*args, compute=torch.float64)
        base = oracle.attention(*args, compute=TORCH_DTYPES[case.dtype])
        if len(_ORACLE_CACHE) >= _ORACLE_CACHE_MAX:
            _ORACLE_CACHE.pop(next(iter(_ORACLE_CACHE)))
        _ORACLE_CACHE[key] = (ref, base)
    return _ORACLE_CACHE[key]


def judge(case: Case, impl: str, reply: PoolReply, oracle_s: float = 0.0, keep_shards: bool = False,
          baseline: dict | None = None) -> CaseResult:
    """Turn the ranks' replies into a CaseResult with exactly one verdict; a faulted case's verdict
    then accounts for its faults (unfired: invalid; benign: bit-identical to the `baseline` run)."""
    res = _judge(case, impl, reply, oracle_s, keep_shards)
    if case.faults:
        from harness.judging import verdicts

        verdicts.apply(res, case, reply, baseline)
    return res


def _judge(case: Case, impl: str, reply: PoolReply, oracle_s: float, keep_shards: bool) -> CaseResult:
    """The fault-unaware verdict: hang, fail-stop, diverged, silent-corruption or pass."""
    off = case.group_offset
    in_group = range(off, off + case.world_size)
    res = CaseResult(case=case, impl=impl, verdict="pass")
    res.timings = {"wall_s": reply.wall_s, "oracle_s": oracle_s, "pool_restarted": reply.restarted}
    res.hung = {r - off: s for r, s in reply.hung.items() if r in in_group}
    res.dead = {r - off: s for r, s in reply.dead.items()}
    outside = {r: s for r, s in {**reply.hung, **reply.dead}.items() if r not in in_group}
    shards, leak_shards, statuses = {}, {}, {}
    for r, rep in reply.replies.items():
        if r not in in_group:
            continue
        g = r - off
        statuses[g] = rep.get("status")
        if rep.get("status") == "ok":
            shards[g] = rep["tensors"]
            res.hashes[g] = rep["hashes"]
            res.timings[f"rank{g}"] = rep.get("timings", {})
            if "leak" in rep:
                leak_shards[g] = rep["leak"]
        elif rep.get("error"):
            res.errors[g] = rep["error"]
        for k in ("comm", "faults"):
            if k in rep:
                res.extra.setdefault(k, {})[g] = rep[k]
    if res.hung:
        res.verdict = "hang"
        res.detail = f"deadline {case.deadline_s:g} s passed; rank(s) {sorted(res.hung)} still running"
        res.detail += "".join(f"; {w}" for w in _pending_ops(res.hung))
        return res
    if outside:
        res.verdict = "fail-stop"
        res.detail = f"ranks outside the ring group failed: {sorted(outside)}"
        return res
    if any(s == "diverged" for s in statuses.values()):
        res.verdict = "diverged"
        res.detail = "; ".join(f"rank {g}: {res.errors[g]}" for g in sorted(res.errors))
        return res
    if res.errors or res.dead:
        res.verdict = "fail-stop"
        parts = [f"rank {g}: {e}" for g, e in sorted(res.errors.items())]
        parts += [f"rank {g} died ({d.split(';')[0]})" for g, d in sorted(res.dead.items())]
        res.detail = "; ".join(parts)
        return res
    ref, base = references(case)
    small = case.batch * case.total_len * case.heads_q <= MAP_LIMIT
    res.checks = check_tensors(case, shards, ref, base, maps=res.maps if small else None)
    if keep_shards:
        res.shards = shards
    res.leak = check_leak(case, leak_shards)
    bad = res.failed_checks()
    if bad or (res.leak is not None and not res.leak.passed):
        res.verdict = "silent-corruption"
        parts = [f"{c.tensor}@rank{c.rank} x{c.ratio:.3g}" for c in sorted(bad, key=lambda c: -c.ratio)[:4]]
        if res.leak is not None and res.leak.leaks:
            lk = res.leak.leaks[0]
            parts.append(f"leak: {lk['tensor']} nonzero at hidden key {lk['token']} on rank {lk['rank']}")
        res.detail = "; ".join(parts)
    return res


def _pending_ops(hung: dict[int, str]) -> list[str]:
    """'rank g last blocked waiting on <op>, pending <op>, ...' from the hung ranks' reports."""
    head, out = "pending ops: ", []
    for _, text in sorted(hung.items()):
        lines = text.splitlines()
        if lines and lines[0].startswith(head):
            rest = [ln.strip() for ln in lines[1:] if ln.startswith("  pending ")]
            out.append(", ".join([lines[0][len(head):], *rest]))
    return out


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


def run_case(case: Case, pool: RankPool, impl: str | None = None, *, allow_import: bool = False,
             leak: bool = True, keep_shards: bool = False) -> CaseResult:
    """Run `case` on the pool (implementation `impl` or the case's own) and judge it; with
    `keep_shards` the result also holds every rank's output tensors (for localisation probes).
    A case with benign faults first runs fault-free (cached) for the bit-identity comparison."""
    name = impl or case.impl
    baseline = None
    if case.faults:
        from harness.judging.verdicts import baseline_for

        baseline = baseline_for(case, pool, name, allow_import)
    t_submit = time.perf_counter()
    ticket = pool.submit(case, name, allow_import=allow_import, leak=leak, whole_world=needs_whole_world(name))
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(oracle_threads(case.world_size))
    try:
        references(case)  # the oracle overlaps with the ranks' work
        oracle_s = time.perf_counter() - t0
        reply = pool.collect(ticket)
        t_judge = time.perf_counter()
        res = judge(case, name, reply, oracle_s, keep_shards, baseline)
    finally:
        torch.set_num_threads(threads)
    res.timings.update(submit_s=t0 - t_submit, collect_s=t_judge - t0 - oracle_s,
                       judge_s=time.perf_counter() - t_judge)  # parent-side phases, for the benchmarks
    return res
