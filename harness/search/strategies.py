"""Public hypothesis strategies that draw whole ring-attention Cases.

Use them in your own tests: `@given(strategies.cases(my_impl.capabilities))`. Only structure and a
seed are drawn, and the ranks build the tensors from the seed. The draws are ordered so that a
failure shrinks towards the simplest case: docs/api.md gives the order. The mask strategies live
in harness.search.mask_strategies, and this module re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from harness.calls import CALLS, INPUT_FORMS, needs_backward, useful_form
from harness.case import Case, make_case
from harness.context import Capabilities
from harness.dtypes import EXACT_INTEGERS
from harness.impls.capabilities import divisible_heads, odd_lengths
from harness.search.mask_strategies import expressions, masks, primitives, shrink_ordered
from harness.search.serving_draws import serving_fields
from harness.search.variants import variant_fields
from ring_impl.layouts import LAYOUTS, all_positions, split_lengths, zigzag_chunks
from ring_impl.masks import MaskSpec

DTYPE_ORDER = ("fp32", "bf16", "fp16")  # shrinks towards the first
# the head dims flash kernels are compiled for
FLASH_HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
# bf16's and fp16's: beyond them, a position computed in the input dtype rounds
EXACT_LIMITS = tuple(sorted(n for n in EXACT_INTEGERS.values() if n < 1 << 16))
# drawn first; the values of trained models by `model_call`
MERGE_VALUES = ("normal", "large", "near-tie")


@st.composite
def seq_lens(
    draw, world_size: int, max_tokens: int = 64, uneven: bool = True, idle: bool = False
) -> tuple[int, ...]:
    """Per-rank lengths: an even split, an uneven one, or the largest that fits.

    An uneven split may hold length-1 shards. With `idle`, some ranks hold no token, never all of
    them.
    """
    w = world_size
    # The total is drawn first on every branch and independently of W, so shrinking the world size
    # keeps the sequence length (and a branch that drew less cannot win the shrink by being
    # shorter).
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


@dataclass(frozen=True)
class Sizes:
    """How large a drawn case may be: `cases(sizes=...)`. The profiles' sizes are `SIZES`.

    Local lengths are drawn log-uniformly up to `max_local`, and `max_total` in all. They may also
    sit on a kernel tile edge (k * tile +- 1). Or the last positions pass a dtype's exact integers
    (EXACT_LIMITS), where `max_total` reaches them. Head dims come from 1-32 or the flash set.
    `max_work` caps batch x heads_q x max(head_dim, WORK_DIM) x total^2, what a case costs the ring
    and the oracle. Batch, then heads, then head_dim give way, never the lengths.
    """

    max_local: int
    max_total: int
    max_head_dim: int = 128
    max_heads: int = 32
    max_batch: int = 4
    max_work: int = 1 << 25


# a score entry costs about as much as 32 multiply-adds of q.k (exp, mask, softmax, backward)
WORK_DIM = 32
SIZES = {
    # hundreds of tokens a rank (1-4 tiles of 64), totals past bf16's 256; fp16's 2048 is the scale
    # stage's
    "ci": Sizes(max_local=320, max_total=800, max_work=1 << 24),
    "nightly": Sizes(max_local=4096, max_total=32768, max_head_dim=256, max_work=1 << 31),
}


def _log_int(draw, cap: int) -> int:
    """1..cap, log-uniform. It shrinks towards 1 through every integer on the way.

    Below ~150, its steps are under 1 token.
    """
    e = draw(st.integers(0, 1000))
    return max(1, min(cap, round(cap ** (e / 1000))))


@st.composite
def scaled_lens(
    draw,
    world_size: int,
    sizes: Sizes,
    tiles: tuple[int, ...] = (64, 128),
    uneven: bool = True,
    idle: bool = False,
) -> tuple[int, ...]:
    """Per-rank lengths at scale.

    A local length is drawn log-uniformly up to sizes.max_local, or on a tile edge, or so that the
    sequence ends just past a dtype's exact integers. Then W x that length is split evenly, or
    unevenly around it, with idle ranks where declared. docs/api.md says why it shrinks well.
    """
    w = world_size
    cap = max(1, min(sizes.max_local, sizes.max_total // w))
    mode = draw(st.sampled_from(("log", "tile-edge", "exact-limit")))
    total = None
    if mode == "log":
        local = _log_int(draw, cap)
    elif mode == "tile-edge":
        t = draw(st.sampled_from([t for t in tiles if t < cap] or [min(tiles)]))
        k = draw(st.integers(1, max(1, (cap - 1) // t)))
        local = max(1, min(cap, k * t + draw(st.sampled_from((1, -1)))))
    else:
        lim = draw(
            st.sampled_from([x for x in EXACT_LIMITS if x + 1 < w * cap] or [EXACT_LIMITS[0]])
        )
        # the last positions: lim + 1, ... (odd ones round)
        total = lim + draw(st.integers(1, 2 * w + 3))
        local = max(1, min(cap, -(-total // w)))
        total = min(total, local * w)
    total = max(total or local * w, w)
    if not uneven or not draw(st.booleans()):
        return (max(1, total // w),) * w if not uneven else tuple(split_lengths(total, w))
    lens = [
        draw(st.integers(0 if idle and w > 1 else 1, max(1, min(cap, 2 * local)))) for _ in range(w)
    ]
    if not any(lens):  # idle ranks, but not all of them
        lens[-1] = 1
    return tuple(lens)


def within_work(
    sizes: Sizes, total: int, batch: int, heads_q: int, heads_kv: int, head_dim: int
) -> tuple[int, int, int, int]:
    """(batch, heads_q, heads_kv, head_dim), cut down until the case's cost fits sizes.max_work.

    The cost is batch x heads_q x max(head_dim, WORK_DIM) x total^2. Batch goes to 1 first. Then the
    heads are halved, keeping the GQA ratio while it can. Then head_dim is halved, to WORK_DIM at
    least: below it a case costs no less.
    """

    def work() -> int:
        return batch * heads_q * max(head_dim, WORK_DIM) * total * total

    if work() > sizes.max_work:
        batch = 1
    while work() > sizes.max_work and heads_q > 1:
        heads_q, heads_kv = max(1, heads_q // 2), max(1, heads_kv // 2)
        if heads_q % heads_kv:
            heads_kv = 1
    while work() > sizes.max_work and head_dim > WORK_DIM:
        head_dim = max(WORK_DIM, head_dim // 2)
    return batch, heads_q, heads_kv, head_dim


def _even_within_budget(lens: tuple[int, ...]) -> tuple[int, ...]:
    """Every odd length made even within the token budget.

    It takes one token less, or gives a length-1 shard one more. An even split stays even.
    """
    return tuple(n - 1 if n % 2 and n > 1 else n + n % 2 for n in map(int, lens))


def boundary_positions(layout: str, lens: tuple[int, ...]) -> list[int]:
    """Global positions that start a new rank's tokens or a new zigzag chunk: the token after an
    edge.
    """
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


def _head_dims(
    caps: Capabilities, max_head_dim: int, flash: bool = False
) -> st.SearchStrategy[int]:
    """A declared head dim, else 1..32, and with `flash` the flash set up to `max_head_dim`."""
    if caps.head_dims:
        dims = sorted(d for d in caps.head_dims if d <= max_head_dim) or [min(caps.head_dims)]
        return st.sampled_from(dims)
    small = st.integers(1, min(32, max_head_dim))
    if not flash:
        return st.integers(1, max_head_dim)
    return st.one_of(
        small, st.sampled_from([d for d in FLASH_HEAD_DIMS if d <= max_head_dim] or [max_head_dim])
    )


def _ring(
    draw, caps: Capabilities, max_world: int, pool_size: int, subgroups: bool
) -> tuple[int, int]:
    """(world_size, group_offset): the ring's size, and where it sits in a pool of `pool_size`."""
    lo, hi = caps.world_sizes
    hi = min(hi, max_world, pool_size)
    if lo > hi:
        raise ValueError(
            f"capabilities need world sizes {caps.world_sizes}, budget allows at most {hi}"
        )
    w = draw(st.integers(lo, hi))
    # always one draw (a skipped draw would make large rings look "simpler" to the shrinker)
    # False: the ring must be global ranks 0..W-1
    inside = subgroups and getattr(caps, "subgroups", True)
    offset = draw(st.integers(0, max(0, pool_size - lo))) % (pool_size - w + 1) if inside else 0
    return w, offset


def _lengths(
    draw, caps: Capabilities, w: int, sizes: Sizes | None, max_tokens: int
) -> tuple[int, ...]:
    """Per-rank lengths: small ones (`seq_lens`), or at scale with `sizes` (`scaled_lens`)."""
    idle = getattr(caps, "idle_ranks", False)
    if sizes is None:
        return draw(seq_lens(w, max(max_tokens, w), caps.uneven, idle))
    return draw(scaled_lens(w, sizes, caps.tiles, caps.uneven, idle))


def _heads_and_dims(
    draw,
    caps: Capabilities,
    w: int,
    total: int,
    sizes: Sizes | None,
    max_heads: int,
    max_head_dim: int,
    max_batch: int,
) -> tuple[int, int, int, int]:
    """(heads_q, heads_kv, head_dim, batch) as declared, cut down to `sizes`' work if given."""
    hq, hkv = draw(heads(caps.gqa, max_heads))
    head_dim = draw(_head_dims(caps, max_head_dim, flash=sizes is not None))
    batch = draw(st.integers(1, max_batch))
    if sizes is not None:
        batch, hq, hkv, d = within_work(sizes, total, batch, hq, hkv, head_dim)
        # a declared head dim stays (heads and batch gave way)
        head_dim = d if not caps.head_dims else head_dim
    if caps.heads_divisible_by_world:
        hq, hkv = divisible_heads(hq, hkv, w)
    return hq, hkv, head_dim, batch


def _layout_and_mask(
    draw, caps: Capabilities, lens: tuple[int, ...], sizes: Sizes | None
) -> tuple[str, tuple[int, ...], MaskSpec]:
    """The layout, the lengths it allows, and a mask aimed at its rank and chunk boundaries."""
    layout = draw(st.sampled_from(shrink_ordered(caps.layouts, LAYOUTS, "layout")))
    if layout == "zigzag" and not caps.zigzag_odd and odd_lengths(lens):
        lens = _even_within_budget(lens)
    total = sum(lens)
    edges = boundary_positions(layout, lens)
    # Mask edges also just past the dtypes' exact integers.
    if sizes is not None:
        edges = sorted({*edges, *(x + 1 for x in EXACT_LIMITS if x + 1 < total)})
    mask = draw(masks(total, tuple(sorted(caps.masks)), tuple(edges)))
    return layout, lens, mask


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
    sizes: Sizes | None = None,
    model_calls: bool = True,
) -> Case:
    """A whole Case the implementation declares it supports.

    Without `sizes`, a case is small enough to run in ~0.1 s: `max_tokens` in all, `max_head_dim`,
    `max_batch`, `max_heads`. With `sizes`, e.g. SIZES["ci"] as the default check draws, it is at
    scale. It then aims at the implementation's kernel tiles (`Capabilities.tiles`) and the dtypes'
    exact integers.

    `pool_size` bounds world_size + group_offset, for a ring inside a subgroup of the pool. The
    capabilities may restrict the zigzag lengths and the head counts:
    - `zigzag_odd=False`: an odd length is made even, one token less. A length-1 shard gets two.
    - `heads_divisible_by_world`: the head counts are rounded up as `adapt` does, and may exceed
      `max_heads`.
    The draws stay the same, so shrinking does. With `model_calls`, how a model calls the ring is
    drawn too (`model_call`). It is drawn last, so every other draw keeps its place in the choice
    sequence.
    """
    caps = caps or Capabilities()
    w, offset = _ring(draw, caps, max_world, pool_size, subgroups)
    lens = _lengths(draw, caps, w, sizes, max_tokens)
    if sizes is not None:
        max_heads, max_head_dim, max_batch = sizes.max_heads, sizes.max_head_dim, sizes.max_batch
    hq, hkv, head_dim, batch = _heads_and_dims(
        draw, caps, w, sum(lens), sizes, max_heads, max_head_dim, max_batch
    )
    layout, lens, mask = _layout_and_mask(draw, caps, lens, sizes)
    dtype = draw(st.sampled_from(shrink_ordered(caps.dtypes, DTYPE_ORDER, "dtype")))
    values = draw(st.sampled_from(MERGE_VALUES))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 1.0, allow_nan=False, allow_infinity=False)))
    seed = draw(st.integers(0, 2**32 - 1))
    extra = draw(model_call(caps)) if model_calls else {}
    # drawn last: an implementation without variants keeps every draw it had
    extra.update(draw(variant_fields(caps, hq, head_dim, sum(lens), max(max_head_dim, head_dim))))
    # drawn after the variants: an implementation of training shapes keeps every draw it had
    served = draw(serving_fields(caps, w, extra.get("call", "train")))
    if served:
        offset, layout, mask, lens = 0, "contiguous", served.pop("mask"), None
        extra.update(served)
        if extra.get("inputs") == "fused-qkv":  # one fused tensor needs as many queries as keys
            del extra["inputs"]
        if served["serving"].get("page_size"):  # a paged KV cache comes with contiguous queries
            extra.pop("inputs", None)
    fields = {"values": values, **extra, **({} if lens is None else {"seq_lens": lens})}
    return make_case(
        world_size=w,
        group_offset=offset,
        heads_q=hq,
        heads_kv=hkv,
        head_dim=head_dim,
        batch=batch,
        layout=layout,
        mask=mask,
        dtype=dtype,
        softmax_scale=scale,
        seed=seed,
        impl=impl,
        deadline_s=deadline_s,
        **fields,
    )


# How a model calls the ring (harness.calls) and the magnitudes of trained models (harness.inputs).
# The plain value comes first and most often: about half the cases keep the training call,
# contiguous inputs and the values drawn above; each value shrinks towards the first.
CALL_DRAWS = ("train",) * 4 + CALLS[1:]
FORM_DRAWS = ("contiguous",) * 3 + INPUT_FORMS[1:]
TRAINED_DRAWS = (None,) * 3 + ("outliers", "qk-overflow", "sink")


@st.composite
def model_call(draw, caps: Capabilities | None = None) -> dict:
    """{call, inputs, values} of a case, drawn within what `caps` declares.

    A forward-only ring gets forward-only calls only, and only its input forms. A key is left out
    when its draw is the plain one.
    """
    caps = caps or Capabilities()
    call = draw(st.sampled_from(CALL_DRAWS))
    form = draw(st.sampled_from([f for f in FORM_DRAWS if f in caps.input_forms] or ["contiguous"]))
    trained = draw(st.sampled_from(TRAINED_DRAWS))
    if needs_backward(call) and not caps.backward:
        call = "no-grad" if call == "train" else "inference-mode"
    form = useful_form(call, form)
    out = {"call": call, "inputs": form, "values": trained}
    return {k: v for k, v in out.items() if v not in ("train", "contiguous", None)}


__all__ = [
    "SIZES",
    "Sizes",
    "boundary_positions",
    "cases",
    "expressions",
    "heads",
    "masks",
    "model_call",
    "primitives",
    "scaled_lens",
    "seq_lens",
]
