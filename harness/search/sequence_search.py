"""The search of a pool's earlier runs for the shortest sequence that reproduces a failure.

`first_reproducing` tries a few candidate prefixes of the earlier runs, shortest first.
`ddmin` then minimises the one that reproduces. Each candidate runs through `reproduces`, which
harness.search.history gives: a run on fresh ranks within a budget. docs/check.md has the steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from harness.case_sequence import Step
from harness.result import CaseResult

# earlier runs -> the failing case's result after them when it fails the same way, else None
Reproduces = Callable[[list[Step]], CaseResult | None]


def first_reproducing(
    prefix: list[Step], last: Step, reproduces: Reproduces
) -> tuple[list[Step] | None, CaseResult | None]:
    """The first candidate prefix that reproduces.

    The candidates are the run just before, the nearest earlier run of the same case, then suffixes
    of 2, 4, 8... runs, then all of them.
    """
    tried: set[tuple[int, int]] = set()
    # (start, stop) ranges of the prefix; (-1, j): the single run j
    cands: list[tuple[int, int]] = []
    n = len(prefix)
    if n:
        cands.append((n - 1, n))
        same = [j for j in range(n - 2, -1, -1) if prefix[j].case == last.case]
        if same:
            cands.append((-1, same[0]))
        k = 2
        while k < n:
            cands.append((n - k, n))
            k *= 2
        cands.append((0, n))
    for a, b in cands:
        if (a, b) in tried:
            continue
        tried.add((a, b))
        sub = [prefix[b]] if a == -1 else prefix[a:b]
        got = reproduces(sub)
        if got is not None:
            return sub, got
    return None, None


def ddmin(
    items: list[Step], result: CaseResult, reproduces: Reproduces
) -> tuple[list[Step], CaseResult]:
    """Delta debugging (Zeller's ddmin) of the earlier runs.

    It returns a list, 1-minimal within the budget, that still reproduces. The empty list is known
    not to reproduce: the case alone passed on fresh ranks.
    """
    n = 2
    while len(items) >= 2:
        size = math.ceil(len(items) / n)
        chunks = [items[k : k + size] for k in range(0, len(items), size)]
        reduced = False
        for sub in chunks + (
            [[x for j, c in enumerate(chunks) if j != i for x in c] for i in range(len(chunks))]
            if len(chunks) > 2
            else []
        ):
            if not sub or len(sub) == len(items):
                continue
            got = reproduces(sub)
            if got is not None:
                items, result, reduced = sub, got, True
                n = 2 if len(sub) <= size else max(n - 1, 2)
                break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items, result
