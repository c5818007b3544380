"""The oracle's outputs of the last few cases, by the case's inputs.

Shrinking and replays re-run the same inputs under other implementations or faults, so a case's
(exact, base) pair is kept. The key leaves out what does not change the inputs: the
implementation, the faults, the tolerance and the deadline.
"""

from __future__ import annotations

from harness.case import Case
from harness.oracle.assemble import Pair, local

_CACHE: dict[str, Pair] = {}
_CACHE_MAX = 8


def _key(case: Case) -> str:
    return case.replace(impl="-", faults=(), tolerance={}, deadline_s=1.0).key()


def lookup(case: Case) -> Pair | None:
    """The case's (exact, base) when already known, else None."""
    return _CACHE.get(_key(case))


def store(case: Case, pair: Pair) -> None:
    """Remember a case's (exact, base), e.g. assembled from the ranks' shares."""
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[_key(case)] = pair


def forget(case: Case) -> None:
    """Drop a case's outputs: a large case's are gigabytes once judged."""
    _CACHE.pop(_key(case), None)


def clear() -> None:
    """Drop every case's outputs."""
    _CACHE.clear()


def outputs(case: Case) -> Pair:
    """(exact, base) for a case: the stored pair, else computed here by `local` and stored."""
    pair = lookup(case)
    if pair is None:
        pair = local(case)
        store(case, pair)
    return pair
