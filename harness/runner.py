"""Run one case end to end: ranks compute on the pool while the parent computes the oracle, then
judge and give the run exactly one verdict."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from harness import inputs, oracle
from harness.case import Case
from harness.judge import LeakCheck, TensorCheck, check_leak, check_tensors
from harness.pool import PoolReply, RankPool

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


def judge(case: Case, impl: str, reply: PoolReply, oracle_s: float = 0.0) -> CaseResult:
    """Turn the ranks' replies into a CaseResult with exactly one verdict."""
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
    res.checks = check_tensors(case, shards, ref, base)
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


def run_case(case: Case, pool: RankPool, impl: str | None = None, *, allow_import: bool = False,
             leak: bool = True) -> CaseResult:
    """Run `case` on the pool (implementation `impl` or the case's own) and judge it."""
    name = impl or case.impl
    ticket = pool.submit(case, name, allow_import=allow_import, leak=leak)
    t0 = time.perf_counter()
    references(case)  # the oracle overlaps with the ranks' work
    oracle_s = time.perf_counter() - t0
    reply = pool.collect(ticket)
    return judge(case, name, reply, oracle_s)
