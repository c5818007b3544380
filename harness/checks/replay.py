"""Replaying a saved case: does the recorded verdict reproduce, and (for a deterministic
implementation on the same torch) do the output hashes match bit for bit?"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from harness import case as case_mod
from harness.ranks.pool import RankPool
from harness.runner import CaseResult, run_case


@dataclass
class Replay:
    """The outcome of replaying one case file."""

    result: CaseResult
    recorded_verdict: str | None
    hash_mismatches: list[str] = field(default_factory=list)
    hashes_compared: int = 0
    hash_note: str = ""

    @property
    def verdict_reproduced(self) -> bool:
        return self.recorded_verdict is None or self.result.verdict == self.recorded_verdict


def compare_hashes(recorded: dict, result: CaseResult) -> tuple[int, list[str]]:
    """(number of shard hashes compared, descriptions of those that differ)."""
    compared, bad = 0, []
    for rank, tensors in (recorded or {}).items():
        got = result.hashes.get(int(rank), {})
        for name, h in tensors.items():
            if name in got:
                compared += 1
                if got[name] != h:
                    bad.append(f"{name}@rank{rank}: recorded {h}, now {got[name]}")
    return compared, bad


def replay(path: str | os.PathLike, pool: RankPool, impl: str | None = None, *, allow_import: bool = False) -> Replay:
    """Re-run a case file (optionally under another implementation) and compare with its record."""
    case, data = case_mod.load(path)
    recorded = data.get("result") or {}
    name = impl or case.impl
    res = run_case(case, pool, name, allow_import=allow_import)
    out = Replay(result=res, recorded_verdict=recorded.get("verdict") if impl in (None, case.impl) else None)
    if out.recorded_verdict is not None and recorded.get("hashes"):
        same_torch = recorded.get("versions", {}).get("torch") == str(torch.__version__)
        out.hashes_compared, out.hash_mismatches = compare_hashes(recorded["hashes"], res)
        if not same_torch:
            out.hash_note = (f"recorded on torch {recorded.get('versions', {}).get('torch')}, "
                             f"replayed on {torch.__version__}: hashes compared for information only")
    return out


def replay_expectations(path: str | os.PathLike, pool: RankPool) -> list[str]:
    """Problems with a corpus case (empty list = fine): the recorded verdict must reproduce with
    identical hashes on the same torch, and a case recorded against any other implementation
    (a mutant, a third-party ring) must pass on the reference."""
    rp = replay(path, pool)
    problems = []
    case = rp.result.case
    if not rp.verdict_reproduced:
        problems.append(f"{case.impl}: recorded verdict {rp.recorded_verdict}, got {rp.result.verdict} "
                        f"({rp.result.detail})")
    elif rp.recorded_verdict is None and not rp.result.passed:
        problems.append(f"{case.impl}: expected pass, got {rp.result.verdict} ({rp.result.detail})")
    if rp.hash_mismatches and not rp.hash_note:
        problems.append("output hashes differ from the record: " + "; ".join(rp.hash_mismatches[:4]))
    if case.impl != "reference":
        ref = run_case(case, pool, "reference")
        if not ref.passed:
            problems.append(f"reference: expected pass, got {ref.verdict} ({ref.detail})")
    return problems
