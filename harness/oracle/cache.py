"""The oracle's outputs of the last few cases, by the case's inputs.

Shrinking and replays re-run the same inputs under other implementations or faults, so a case's
(exact, base) pair is kept. The key leaves out what does not change the inputs: the
implementation, the faults, the tolerance and the deadline.
"""

from __future__ import annotations

from harness.case import Case
from harness.oracle.assemble import Pair, local, whole

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
    _CACHE.pop(_key(case) + "|whole", None)


def clear() -> None:
    """Drop every case's outputs."""
    _CACHE.clear()


def outputs(case: Case, mode: str | None = None) -> Pair:
    """(exact, base) for a case: the stored pair, else computed here and stored.

    `mode` "whole": in one pass (`assemble.whole`), kept apart from the shares' pair, whose base
    rounds otherwise. "local" or "ranks": share by share (`assemble.local`). None: whichever is
    stored, e.g. for the exact outputs of a case just judged, else share by share."""
    whole_key, shares_key = _key(case) + "|whole", _key(case)
    keys = {"whole": [whole_key], None: [whole_key, shares_key]}.get(mode, [shares_key])
    for key in keys:
        if key in _CACHE:
            return _CACHE[key]
    pair = whole(case) if mode == "whole" else local(case)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[keys[0] if mode == "whole" else shares_key] = pair
    return pair
