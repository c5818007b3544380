"""Hypothesis strategies that draw attention masks, aimed at rank and chunk boundaries.

`masks` draws a mask of the kinds an implementation declares. Where it declares the mask language
("expr", ring_impl.masks), `expressions` draws one of its declared primitives (`primitives`) and
combinators. Edges fall on or next to the boundaries where a rank's tokens start. The draws shrink
towards the simplest mask: docs/api.md gives the order. harness.search.strategies re-exports them.
"""

from __future__ import annotations

from hypothesis import strategies as st

from ring_impl.masks import COMBINATORS, EXPR, MASK_KINDS, WINDOW_RIGHT, Expr, MaskSpec, prim

MAX_DOCS = 6
SMALL_WINDOW = 3
# primitives in shrink order (simplest first); an expression shrinks towards one leaf, then towards
# these
PRIMITIVE_ORDER = (
    "causal",
    "full",
    "window",
    "prefix",
    "chunked",
    "document",
    "inverse-causal",
    "dilated",
    "blocks",
)
MAX_DEPTH = 2


def shrink_ordered(
    allowed: frozenset[str] | set[str], order: tuple[str, ...], what: str
) -> list[str]:
    """The allowed choices in shrink order. An implementation that supports none is refused.

    The case strategies (harness.search.strategies) order layouts and dtypes with it too.
    """
    out = [x for x in order if x in allowed]
    if not out:
        raise ValueError(f"capabilities allow no {what} (got {sorted(allowed)})")
    return out


def _near(boundaries: tuple[int, ...], lo: int, hi: int) -> st.SearchStrategy[int]:
    """An integer in [lo, hi], half the time on or next to one of `boundaries`.

    A boundary is a rank or zigzag-chunk start. A window, chunk, segment or prefix edge then falls
    exactly on a block edge.
    """
    near = sorted({b + d for b in boundaries for d in (-1, 0, 1) if lo <= b + d <= hi})
    return st.one_of(st.integers(lo, hi), st.sampled_from(near)) if near else st.integers(lo, hi)


@st.composite
def primitives(draw, total: int, kinds: frozenset[str], boundaries: tuple[int, ...] = ()) -> Expr:
    """One primitive of the declared `kinds`, its parameters drawn towards rank and chunk
    boundaries.

    Examples are a window reaching exactly to the previous rank, a chunk or dilation segment ending
    where a shard ends, a prefix ending at a shard start, and document starts on shard starts.
    """
    op = draw(st.sampled_from(shrink_ordered(kinds, PRIMITIVE_ORDER, "mask primitive")))
    n = max(1, total)
    gaps = tuple(b2 - b1 for b1, b2 in zip(boundaries, boundaries[1:], strict=False))
    # shard lengths and starts: edges on block edges
    widths = tuple(b for b in boundaries if b > 0) + gaps
    if op == "window":
        right = st.one_of(st.just(0), _near(widths, 0, n)) if WINDOW_RIGHT in kinds else st.just(0)
        return prim("window", draw(_near(widths, 0, n)), draw(right))
    if op == "prefix":
        return prim("prefix", draw(_near(boundaries, 0, n)))
    if op == "chunked":
        return prim("chunked", draw(_near(widths, 1, n)))
    if op == "dilated":
        seg = draw(_near(widths, 1, n))
        rate = draw(st.integers(1, max(1, min(4, seg))))
        return prim("dilated", seg, rate, draw(st.integers(0, rate - 1)))
    if op == "document":
        if n == 1:
            return prim("document", (0,))
        starts = draw(
            st.lists(_near(boundaries, 1, n - 1), max_size=min(MAX_DOCS - 1, n - 1), unique=True)
        )
        return prim("document", (0, *sorted(starts)))
    if op == "blocks":
        size = draw(_near(widths, 1, n))
        nb = min(8, -(-n // size))
        block = st.integers(0, nb - 1)
        pairs = draw(st.lists(st.tuples(block, block), max_size=nb * 2, unique=True))
        return prim("blocks", size, tuple(pairs))
    return prim(op)


@st.composite
def expressions(
    draw, total: int, kinds: frozenset[str], boundaries: tuple[int, ...] = (), depth: int = 0
) -> Expr:
    """A mask expression of the declared primitives and combinators, at most MAX_DEPTH deep.

    It shrinks towards a single primitive.
    """
    ops = ["leaf"] + [c for c in COMBINATORS if c in kinds and depth < MAX_DEPTH]
    op = draw(st.sampled_from(ops))
    if op == "leaf":
        return draw(primitives(total, kinds, boundaries))
    sub = expressions(total, kinds, boundaries, depth + 1)
    if op == "not":
        return Expr("not", args=(draw(sub),))
    # documents starting on shard edges, the operand relative to each start
    if op == "per-document":
        n = max(1, total)
        starts = (
            draw(
                st.lists(
                    _near(boundaries, 1, n - 1), max_size=min(MAX_DOCS - 1, n - 1), unique=True
                )
            )
            if n > 1
            else []
        )
        return Expr(op, ((0, *sorted(starts)),), (draw(sub),))
    return Expr(op, args=tuple(draw(st.lists(sub, min_size=2, max_size=3))))


@st.composite
def masks(
    draw, total: int, kinds: tuple[str, ...] = MASK_KINDS, boundaries: tuple[int, ...] = ()
) -> MaskSpec:
    """A mask: none, causal, a window (often a small one), packed documents, or an expression.

    Document starts are drawn at random, or on or next to rank and chunk `boundaries`, so documents
    straddle ranks. Where the implementation declares "expr" (ring_impl.masks), an expression of its
    declared primitives is drawn towards those boundaries (`expressions`).
    """
    declared = set(kinds)
    kinds_ordered = shrink_ordered(declared, (*MASK_KINDS, EXPR), "mask kind")
    # about a third of the draws: the language's share of what users train with
    if EXPR in declared:
        kinds_ordered.append(EXPR)
    kind = draw(st.sampled_from(kinds_ordered))
    if kind == EXPR:
        prims = (
            frozenset(k for k in declared if k in PRIMITIVE_ORDER)
            | frozenset(declared & set(COMBINATORS))
            | frozenset(declared & {WINDOW_RIGHT})
        )
        if not prims & set(PRIMITIVE_ORDER):
            return MaskSpec("none")
        return MaskSpec.of(draw(expressions(total, prims, boundaries)))
    if kind in ("none", "causal"):
        return MaskSpec(kind)
    if kind == "window":
        return MaskSpec(
            "window", window=draw(st.one_of(st.integers(0, SMALL_WINDOW), st.integers(0, total)))
        )
    if total == 1:
        return MaskSpec("document", doc_starts=(0,), causal=draw(st.sampled_from((True, False))))
    near = sorted({p + d for p in boundaries for d in (-1, 0, 1) if 1 <= p + d < total})
    start = (
        st.one_of(st.sampled_from(near), st.integers(1, total - 1))
        if near
        else st.integers(1, total - 1)
    )
    starts = draw(st.lists(start, max_size=min(MAX_DOCS - 1, total - 1), unique=True))
    causal = draw(st.sampled_from((True, False)))
    return MaskSpec("document", doc_starts=(0, *sorted(starts)), causal=causal)
