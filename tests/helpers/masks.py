"""The README's mask definitions as a brute-force predicate (independent of ring_impl.masks), shared
by the mask tests and the oracle's independent check."""

from __future__ import annotations

from ring_impl.masks import Expr, MaskSpec


def _doc(starts, p: int) -> int:
    return max(n for n, s in enumerate(starts) if s <= p)


def brute_expr(e: Expr, i: int, j: int) -> bool:
    """Query at global position i may attend key j under the expression `e` (one pair at a time)."""
    op, p = e.op, e.params
    if op == "and":
        return all(brute_expr(a, i, j) for a in e.args)
    if op == "or":
        return any(brute_expr(a, i, j) for a in e.args)
    if op == "not":
        return not brute_expr(e.args[0], i, j)
    if op == "per-document":
        di, dj = _doc(p[0], i), _doc(p[0], j)
        return di == dj and brute_expr(e.args[0], i - p[0][di], j - p[0][dj])
    if op == "full":
        return True
    if op == "causal":
        return j <= i
    if op == "inverse-causal":
        return j >= i
    if op == "window":
        left, right = p
        return i - left <= j <= i + right
    if op == "chunked":
        return i // p[0] == j // p[0]
    if op == "dilated":
        seg, rate, off = p
        return (
            i // seg == j // seg
            and (i - i // seg * seg) % rate == off
            and (j - j // seg * seg) % rate == off
        )
    if op == "prefix":
        return j < p[0]
    if op == "document":
        return _doc(p[0], i) == _doc(p[0], j)
    if op == "blocks":
        return (i // p[0], j // p[0]) in set(p[1])
    raise AssertionError(f"unknown op {op}")


def brute(spec: MaskSpec, i: int, j: int) -> bool:
    """Query at global position i may attend key at global position j."""
    if spec.kind == "expr":
        return brute_expr(spec.expr, i, j)
    if spec.kind == "none":
        return True
    if spec.kind == "causal":
        return j <= i
    if spec.kind == "window":
        return i - spec.window <= j <= i
    return _doc(spec.doc_starts, i) == _doc(spec.doc_starts, j) and (j <= i or not spec.causal)
