"""The README's mask definitions as a brute-force predicate (independent of ring_impl.masks), shared by
the mask tests and the oracle's independent check."""

from __future__ import annotations

from ring_impl.masks import MaskSpec


def brute(spec: MaskSpec, i: int, j: int) -> bool:
    """Query at global position i may attend key at global position j."""
    if spec.kind == "none":
        return True
    if spec.kind == "causal":
        return j <= i
    if spec.kind == "window":
        return i - spec.window <= j <= i

    def doc(p: int) -> int:
        return max(n for n, s in enumerate(spec.doc_starts) if s <= p)

    return doc(i) == doc(j) and (j <= i or not spec.causal)
