"""Public hypothesis strategies that draw whole ring-attention Cases.

Use them in your own tests: `@given(strategies.cases(my_impl.capabilities))`. Draws are ordered
so that hypothesis shrinks a failure towards the smallest world size, then the shortest sequence,
the fewest heads and the simplest mask (none < causal < window < document < an expression of the mask
language, itself shrinking towards one primitive), then fp32, normal
values and the default softmax scale. Only structure and a seed are drawn; tensors are built from
the seed inside the ranks.
"""

from __future__ import annotations

from hypothesis import strategies as st

from harness.case import Case, make_case
from harness.context import Capabilities
from harness.impls.capabilities import divisible_heads, odd_lengths
from ring_impl.layouts import LAYOUTS, all_positions, split_lengths, zigzag_chunks
from ring_impl.masks import COMBINATORS, EXPR, MASK_KINDS, WINDOW_RIGHT, Expr, MaskSpec, prim

DTYPE_ORDER = ("fp32", "bf16", "fp16")  # shrinks towards the first
VALUE_KINDS = ("normal", "large", "near-tie")
MAX_DOCS = 6
SMALL_WINDOW = 3


def _ordered(allowed: frozenset[str] | set[str], order: tuple[str, ...], what: str) -> list[str]:
    """The allowed choices in shrink order; refuse an implementation that supports none."""
    out = [x for x in order if x in allowed]
    if not out:
        raise ValueError(f"capabilities allow no {what} (got {sorted(allowed)})")
    return out


@st.composite
def seq_lens(draw, world_size: int, max_tokens: int = 64, uneven: bool = True, idle: bool = False) -> tuple[int, ...]:
    """Per-rank lengths: an even split, an uneven one (incl. length-1 shards, and with `idle` ranks that hold
    no token: never all of them), or the largest that fits."""
    w = world_size
    # The total is drawn first on every branch and independently of W, so shrinking the world size
    # keeps the sequence length (and a branch that drew less cannot win the shrink by being shorter).
    total = max(draw(st.integers(1, max(max_tokens, w))), w)
    split = draw(st.sampled_from(("even", "uneven", "max") if uneven else ("even", "max")))
    if split == "max":
        total = max(max_tokens, w)
    if not uneven:
        return (max(1, total // w),) * w
    if split != "uneven":
        return tuple(split_lengths(total, w))
    per = max(1, max_tokens // w)
    lens, left = [], max(max_tokens, w)
    for r in range(w):
        cap = max(1, min(2 * per, left - (w - r - 1)))
        lens.append(draw(st.integers(0 if idle and w > 1 else 1, cap)))
        left -= lens[-1]
    if not any(lens):  # idle ranks, but not all of them
        lens[-1] = 1
    return tuple(lens)


def _even_within_budget(lens: tuple[int, ...]) -> tuple[int, ...]:
    """Every odd length made even within the token budget: one token less, a length-1 shard one more (an
    even split stays even)."""
    return tuple(n - 1 if n % 2 and n > 1 else n + n % 2 for n in map(int, lens))


def boundary_positions(layout: str, lens: tuple[int, ...]) -> list[int]:
    """Global positions that start a new rank's tokens or a new zigzag chunk (the token after an edge)."""
    total = sum(lens)
    owner = [0] * total
    for r, pos in enumerate(all_positions(layout, lens)):
        for p in pos.tolist():
            owner[p] = r
    edges = {p for p in range(1, total) if owner[p] != owner[p - 1]}
    if layout == "zigzag":
        start = 0
        for _, size in zigzag_chunks(lens):
            start += size
            if 0 < start < total:
                edges.add(start)
    return sorted(edges)


# primitives in shrink order (simplest first); an expression shrinks towards one leaf, then towards these
PRIMITIVE_ORDER = ("causal", "full", "window", "prefix", "chunked", "document", "inverse-causal", "dilated",
                   "blocks")
MAX_DEPTH = 2


def _near(boundaries: tuple[int, ...], lo: int, hi: int) -> st.SearchStrategy[int]:
    """An integer in [lo, hi], half the time on or next to one of `boundaries` (a rank or zigzag-chunk
    start), so that a window, chunk, segment or prefix edge falls exactly on a block edge."""
    near = sorted({b + d for b in boundaries for d in (-1, 0, 1) if lo <= b + d <= hi})
    return st.one_of(st.integers(lo, hi), st.sampled_from(near)) if near else st.integers(lo, hi)


@st.composite
def primitives(draw, total: int, kinds: frozenset[str], boundaries: tuple[int, ...] = ()) -> Expr:
    """One primitive of the declared `kinds`, its parameters drawn towards rank and chunk boundaries: a
    window reaching exactly to the previous rank, a chunk or dilation segment ending where a shard ends, a
    prefix ending at a shard start, document starts on shard starts."""
    op = draw(st.sampled_from(_ordered(kinds, PRIMITIVE_ORDER, "mask primitive")))
    n = max(1, total)
    gaps = tuple(b2 - b1 for b1, b2 in zip(boundaries, boundaries[1:], strict=False))
    widths = tuple(b for b in boundaries if b > 0) + gaps  # shard lengths and starts: edges on block edges
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
        starts = draw(st.lists(_near(boundaries, 1, n - 1), max_size=min(MAX_DOCS - 1, n - 1), unique=True))
        return prim("document", (0, *sorted(starts)))
    if op == "blocks":
        size = draw(_near(widths, 1, n))
        nb = min(8, -(-n // size))
        block = st.integers(0, nb - 1)
        pairs = draw(st.lists(st.tuples(block, block), max_size=nb * 2, unique=True))
        return prim("blocks", size, tuple(pairs))
    return prim(op)


@st.composite
def expressions(draw, total: int, kinds: frozenset[str], boundaries: tuple[int, ...] = (), depth: int = 0) -> Expr:
    """A mask expression of the declared primitives and combinators, at most MAX_DEPTH deep; shrinks
    towards a single primitive."""
    ops = ["leaf"] + [c for c in COMBINATORS if c in kinds and depth < MAX_DEPTH]
    op = draw(st.sampled_from(ops))
    if op == "leaf":
        return draw(primitives(total, kinds, boundaries))
    sub = expressions(total, kinds, boundaries, depth + 1)
    if op == "not":
        return Expr("not", args=(draw(sub),))
    if op == "per-document":  # documents starting on shard edges, the operand relative to each start
        n = max(1, total)
        starts = draw(st.lists(_near(boundaries, 1, n - 1), max_size=min(MAX_DOCS - 1, n - 1), unique=True)) \
            if n > 1 else []
        return Expr(op, ((0, *sorted(starts)),), (draw(sub),))
    return Expr(op, args=tuple(draw(st.lists(sub, min_size=2, max_size=3))))


@st.composite
def masks(draw, total: int, kinds: tuple[str, ...] = MASK_KINDS, boundaries: tuple[int, ...] = ()) -> MaskSpec:
    """none, causal, a window (often a small one), packed documents whose starts are drawn at random or
    on/next to rank and chunk `boundaries` (so documents straddle ranks), or, where the implementation
    declares "expr" (ring_impl.masks), an expression of its declared primitives drawn towards those
    boundaries (`expressions`)."""
    declared = set(kinds)
    kinds_ordered = _ordered(declared, (*MASK_KINDS, EXPR), "mask kind")
    if EXPR in declared:  # about a third of the draws: the language's share of what users train with
        kinds_ordered.append(EXPR)
    kind = draw(st.sampled_from(kinds_ordered))
    if kind == EXPR:
        prims = (frozenset(k for k in declared if k in PRIMITIVE_ORDER) | frozenset(declared & set(COMBINATORS))
                 | frozenset(declared & {WINDOW_RIGHT}))
        if not prims & set(PRIMITIVE_ORDER):
            return MaskSpec("none")
        return MaskSpec.of(draw(expressions(total, prims, boundaries)))
    if kind in ("none", "causal"):
        return MaskSpec(kind)
    if kind == "window":
        return MaskSpec("window", window=draw(st.one_of(st.integers(0, SMALL_WINDOW), st.integers(0, total))))
    if total == 1:
        return MaskSpec("document", doc_starts=(0,), causal=draw(st.sampled_from((True, False))))
    near = sorted({p + d for p in boundaries for d in (-1, 0, 1) if 1 <= p + d < total})
    start = st.one_of(st.sampled_from(near), st.integers(1, total - 1)) if near else st.integers(1, total - 1)
    starts = draw(st.lists(start, max_size=min(MAX_DOCS - 1, total - 1), unique=True))
    causal = draw(st.sampled_from((True, False)))
    return MaskSpec("document", doc_starts=(0, *sorted(starts)), causal=causal)


@st.composite
def heads(draw, gqa: bool = True, max_heads: int = 6) -> tuple[int, int]:
    """(heads_q, heads_kv): MHA, GQA (groups of 2-3) or MQA (one K/V head)."""
    kind = draw(st.sampled_from(("mha", "gqa", "mqa") if gqa and max_heads >= 2 else ("mha",)))
    if kind == "mha":
        h = draw(st.integers(1, min(2, max_heads)))
        return h, h
    if kind == "mqa":
        return draw(st.integers(2, max_heads)), 1
    kv = draw(st.integers(2, max(2, max_heads // 2)))
    groups = draw(st.integers(2, max(2, max_heads // kv)))
    return kv * groups, kv


def _head_dims(caps: Capabilities, max_head_dim: int) -> st.SearchStrategy[int]:
    if caps.head_dims:
        dims = sorted(d for d in caps.head_dims if d <= max_head_dim) or [min(caps.head_dims)]
        return st.sampled_from(dims)
    return st.integers(1, max_head_dim)


@st.composite
def cases(
    draw,
    caps: Capabilities | None = None,
    *,
    impl: str = "reference",
    max_world: int = 8,
    pool_size: int = 8,
    max_tokens: int = 64,
    max_head_dim: int = 32,
    max_batch: int = 2,
    max_heads: int = 6,
    subgroups: bool = True,
    deadline_s: float = 60.0,
) -> Case:
    """A whole Case the implementation declares it supports, small enough to run in ~0.1 s.

    `pool_size` bounds world_size + group_offset (a ring inside a subgroup of the pool). Where the
    capabilities say so, zigzag cases get even local lengths (`zigzag_odd=False`: an odd length is made
    even, one token less, a length-1 shard two tokens) and head counts W divides (`heads_divisible_by_world`:
    rounded up as `adapt` does, so they may exceed `max_heads`); the draws stay the same, so shrinking does.
    """
    caps = caps or Capabilities()
    lo, hi = caps.world_sizes
    hi = min(hi, max_world, pool_size)
    if lo > hi:
        raise ValueError(f"capabilities need world sizes {caps.world_sizes}, budget allows at most {hi}")
    w = draw(st.integers(lo, hi))
    # always one draw (a skipped draw would make large rings look "simpler" to the shrinker)
    inside = subgroups and getattr(caps, "subgroups", True)  # False: the ring must be global ranks 0..W-1
    offset = draw(st.integers(0, max(0, pool_size - lo))) % (pool_size - w + 1) if inside else 0
    lens = draw(seq_lens(w, max(max_tokens, w), caps.uneven, getattr(caps, "idle_ranks", False)))
    hq, hkv = draw(heads(caps.gqa, max_heads))
    if caps.heads_divisible_by_world:
        hq, hkv = divisible_heads(hq, hkv, w)
    head_dim = draw(_head_dims(caps, max_head_dim))
    batch = draw(st.integers(1, max_batch))
    layout = draw(st.sampled_from(_ordered(caps.layouts, LAYOUTS, "layout")))
    if layout == "zigzag" and not caps.zigzag_odd and odd_lengths(lens):
        lens = _even_within_budget(lens)
    total = sum(lens)
    mask = draw(masks(total, tuple(sorted(caps.masks)), tuple(boundary_positions(layout, lens))))
    dtype = draw(st.sampled_from(_ordered(caps.dtypes, DTYPE_ORDER, "dtype")))
    values = draw(st.sampled_from(VALUE_KINDS))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 1.0, allow_nan=False, allow_infinity=False)))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_case(world_size=w, group_offset=offset, seq_lens=lens, heads_q=hq, heads_kv=hkv, head_dim=head_dim,
                     batch=batch, layout=layout, mask=mask, dtype=dtype, values=values, softmax_scale=scale,
                     seed=seed, impl=impl, deadline_s=deadline_s)


__all__ = ["boundary_positions", "cases", "expressions", "heads", "masks", "primitives", "seq_lens"]
