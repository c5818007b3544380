"""The default fixed battery: a few dozen small cases that together cover every feature.

An implementation that declares fewer features gets every case adapted to the nearest declared
feature (`harness.impls.capabilities.adapt`), not fewer cases. docs/check.md lists what the cases
cover.
"""

from __future__ import annotations

from harness.case import Case, make_case
from harness.search import variants as variant_cases
from ring_impl.layouts import split_lengths
from ring_impl.masks import Expr, MaskSpec, and_, not_, or_, prim

MASKS = {
    "none": MaskSpec("none"),
    "causal": MaskSpec("causal"),
    "window": MaskSpec("window", window=5),
}


def _docs(total: int) -> MaskSpec:
    """Documents of uneven sizes whose boundaries straddle rank and chunk boundaries."""
    starts = [0, max(1, total // 5), max(2, total // 2 + 1), max(3, total - 3)]
    return MaskSpec("document", doc_starts=tuple(sorted(set(s for s in starts if s < total))))


def default_battery(
    world_size: int = 4,
    dtype: str | None = None,
    impl: str = "reference",
    model_calls: bool = True,
    variants: bool = True,
) -> list[Case]:
    """The fixed battery around `world_size`.

    `dtype` restricts it to one dtype. With `model_calls`, the cases of how models call a ring
    (`model_call_cases`) run last; with `variants`, the attention variants' after them
    (harness.search.variants).
    """
    w = world_size
    # Not divisible by W or 2W: every layout gets uneven shards.
    total = 6 * w + 3
    b = _Cases(w, total, impl)
    _layouts_and_masks(b)
    # every layout x mask, non-causal documents, and the zigzag case inserted below
    basics = len(b.cases) + 1
    _dtypes_and_values(b)
    _heads_and_scale(b)
    _uneven_lengths(b)
    _world_sizes(b)
    _even_splits(b)
    _insert_odd_zigzag(b)
    # the mask language (ring_impl.masks) and idle ranks, seeded after everything above so those
    # cases keep their seeds: every primitive and combinator, edges on shard edges, rows and ranks
    # that see nothing
    for layout, lens, mask in language_cases(w, total):
        b.add(layout=layout, seq_lens=lens, mask=mask, heads_q=4, heads_kv=2)
    _disjoint_subgroup(b)
    b.cases = _run_order(b.cases, basics, len(language_cases(w, total)))
    if model_calls:
        for kw in model_call_cases(w):
            b.add(**kw)
    if variants:
        for kw in variant_cases.battery_cases(w):
            b.add(**kw)
    cases = b.cases
    if dtype is not None:
        cases = [c.replace(dtype=dtype) for c in cases]
    return cases


class _Cases:
    """The battery's cases in the order they are added.

    Each case gets the next seed, and by default the battery's world size, implementation and
    total length.
    """

    def __init__(self, w: int, total: int, impl: str) -> None:
        self.w, self.total, self.impl = w, total, impl
        self.cases: list[Case] = []

    def add(self, **kw) -> None:
        kw.setdefault("world_size", self.w)
        kw.setdefault("impl", self.impl)
        kw.setdefault("seed", len(self.cases) + 1)
        if "seq_lens" not in kw:
            kw.setdefault("total_len", self.total)
        self.cases.append(make_case(**kw))


def _layouts_and_masks(b: _Cases) -> None:
    """Every layout under every plain mask and under documents, then non-causal documents."""
    total = b.total
    for layout in ("contiguous", "zigzag", "striped"):
        for mask in MASKS.values():
            b.add(layout=layout, mask=mask, heads_q=2, heads_kv=2, head_dim=16)
        b.add(layout=layout, mask=_docs(total), heads_q=2, heads_kv=2, head_dim=16)
    b.add(
        layout="zigzag", mask=MaskSpec("document", doc_starts=_docs(total).doc_starts, causal=False)
    )


def _dtypes_and_values(b: _Cases) -> None:
    """fp16 and bf16 on a few layouts and masks, and the large and near-tie values."""
    for dt in ("fp16", "bf16"):
        for layout, mask in (
            ("zigzag", MASKS["causal"]),
            ("striped", MASKS["window"]),
            ("contiguous", _docs(b.total)),
        ):
            b.add(layout=layout, mask=mask, dtype=dt, heads_q=4, heads_kv=2, head_dim=32)
        b.add(layout="contiguous", mask=MASKS["causal"], dtype=dt, values="large", head_dim=32)
    b.add(layout="zigzag", mask=MASKS["causal"], values="near-tie")
    b.add(layout="contiguous", mask=MASKS["causal"], values="large")


def _heads_and_scale(b: _Cases) -> None:
    """GQA and MQA, batch > 1, an odd head_dim and a custom scale."""
    b.add(layout="zigzag", mask=MASKS["causal"], heads_q=4, heads_kv=2, batch=2)
    b.add(layout="striped", mask=MASKS["none"], heads_q=6, heads_kv=1, head_dim=24)
    b.add(layout="contiguous", mask=MASKS["causal"], head_dim=13, softmax_scale=0.3)


def _uneven_lengths(b: _Cases) -> None:
    """Arbitrary per-rank lengths, including a one-token shard. None on one rank."""
    w = b.w
    if w < 2:
        return
    lens = tuple([5, 1, 17, 3][i % 4] + (i // 4) for i in range(w))
    for layout in ("contiguous", "zigzag", "striped"):
        b.add(layout=layout, mask=MASKS["causal"], seq_lens=lens, heads_q=4, heads_kv=2)
    b.add(layout="contiguous", mask=MASKS["window"], seq_lens=lens)


def _world_sizes(b: _Cases) -> None:
    """Other world sizes, and a ring inside a subgroup of a larger pool."""
    w = b.w
    for other in sorted({1, 2, 3, 8} - {w}):
        b.add(
            world_size=other,
            total_len=6 * other + 1,
            layout="zigzag",
            mask=MASKS["causal"],
            heads_q=4,
            heads_kv=2,
        )
        b.add(
            world_size=other, total_len=5 * other + 2, layout="striped", mask=_docs(5 * other + 2)
        )
    b.add(
        world_size=max(2, min(w, 3)),
        group_offset=1,
        layout="zigzag",
        mask=MASKS["causal"],
        total_len=6 * max(2, min(w, 3)) + 1,
    )


def _even_splits(b: _Cases) -> None:
    """An even split at every world size. The cases above are uneven on purpose."""
    for ws in sorted({1, 2, 3, 8, b.w}):
        b.add(
            world_size=ws,
            total_len=8 * ws,
            layout="contiguous",
            mask=MASKS["causal"],
            heads_q=4,
            heads_kv=2,
        )


def _insert_odd_zigzag(b: _Cases) -> None:
    """An even split with an odd local length in the zigzag layout, before every zigzag case.

    It gives two unequal chunks per rank. Every other zigzag case has odd lengths only in an uneven
    split. It is bf16 with a flash head_dim.
    """
    # For a ring that needs even chunks (`Capabilities.zigzag_odd`) it is the one undeclared
    # feature. The check probes an undeclared feature with the first case using it, so this one goes
    # before the other zigzag cases; seeded after the rest, so theirs do not change
    first_zigzag = next(i for i, c in enumerate(b.cases) if c.layout == "zigzag")
    b.cases.insert(
        first_zigzag,
        make_case(
            world_size=b.w,
            seq_lens=(3,) * b.w,
            layout="zigzag",
            mask=MASKS["causal"],
            dtype="bf16",
            heads_q=4,
            heads_kv=2,
            head_dim=32,
            impl=b.impl,
            seed=len(b.cases) + 1,
        ),
    )


def _disjoint_subgroup(b: _Cases) -> None:
    """A second subgroup, disjoint from ranks 0..W-1, seeded after everything above.

    Global ranks 2 and 3 form it: a CP group beside a TP or DP group.
    """
    # In the subgroup above (global ranks 1..3) a group-local rank read as a global one can still
    # name a member, so a ring that confuses the two talks to the wrong process or to itself, and
    # what it does depends on timing; here every such peer is outside the group and the ring fails
    # the same way on every run
    b.add(world_size=2, group_offset=2, layout="contiguous", mask=MASKS["causal"], total_len=7)


def _run_order(cases: list[Case], basics: int, n_language: int) -> list[Case]:
    """The cases in run order; their seeds stay.

    The disjoint subgroup and the mask language run right after the basics, not last. So a ring
    wrong on one primitive, on an idle rank or on group ranks fails within the first ~25 cases
    (selftest: those mutants were found after ~65 runs).
    """
    return (
        cases[:basics] + cases[-1:] + cases[-n_language - 1 : -1] + cases[basics : -n_language - 1]
    )


def model_call_cases(w: int) -> list[dict]:
    """How models call a ring (harness.calls, harness.inputs): one case each, seeded after the rest.

    - The calls: evaluation (no_grad), serving (inference_mode), activation checkpointing both ways.
    - The input forms: q, k, v as views of a fused projection (split for GQA, unbind for MHA), or
      transposed from (b, h, s, d). A transposed dout.
    - The magnitudes of trained models: outlier channels, raw q.k past fp16's range, an attention
      sink.

    The cases are causal zigzag and striped where a layout matters. A forward-only path that skips
    blocks by rank order is right on contiguous only.
    """
    total = 6 * w + 3
    causal, window = MASKS["causal"], MASKS["window"]
    gqa = {"heads_q": 4, "heads_kv": 2}
    return [
        dict(call="no-grad", layout="zigzag", mask=causal, **gqa),
        dict(
            call="inference-mode", layout="striped", mask=causal, dtype="bf16", head_dim=32, **gqa
        ),
        dict(
            call="checkpoint-reentrant",
            layout="zigzag",
            mask=causal,
            dtype="bf16",
            head_dim=32,
            **gqa,
        ),
        dict(call="checkpoint", layout="contiguous", mask=window, **gqa),
        dict(inputs="fused-qkv", layout="zigzag", mask=causal, **gqa),
        dict(
            inputs="fused-qkv",
            layout="contiguous",
            mask=causal,
            dtype="fp16",
            heads_q=2,
            heads_kv=2,
            head_dim=32,
        ),
        dict(inputs="transposed", layout="striped", mask=causal, dtype="bf16", head_dim=32, **gqa),
        dict(inputs="strided-dout", layout="contiguous", mask=causal, **gqa),
        dict(
            values="qk-overflow",
            layout="contiguous",
            mask=causal,
            dtype="fp16",
            head_dim=32,
            total_len=total + 8,
        ),
        dict(values="outliers", layout="zigzag", mask=causal, dtype="bf16", head_dim=32, **gqa),
        dict(
            values="sink",
            layout="striped",
            mask=causal,
            dtype="fp16",
            head_dim=32,
            total_len=8 * w + 5,
        ),
    ]


def language_cases(w: int, total: int) -> list[tuple[str, tuple[int, ...], MaskSpec]]:
    """(layout, seq_lens, mask) of the battery's mask-language cases at world size `w`.

    They are Llama 4 chunked attention and prefix-LM with an idle rank, a bidirectional window,
    LongNet dilation, a block table with inverse-causal, documents without their prefix, a mask that
    leaves whole ranks seeing nothing, and block-causal attention inside each packed document
    (per-document).
    """
    idle = tuple([7, 0, 11, 9][i % 4] + i // 4 for i in range(w)) if w >= 2 else (total,)
    even = tuple(split_lengths(total, w))
    n_idle = sum(idle)
    # The first shard's end: chunk, prefix and segment edges fall on it or next to it.
    first = idle[0]
    docs = tuple(sorted({0, max(1, first - 2), min(n_idle - 1, first + 5)}))
    return [
        ("contiguous", idle, MaskSpec.of(and_(prim("causal"), prim("chunked", first + 1)))),
        (
            "zigzag",
            idle,
            MaskSpec.of(or_(prim("causal"), prim("prefix", min(n_idle - 1, first + 3)))),
        ),
        ("striped", even, MaskSpec.of(prim("window", 3, 2))),
        ("contiguous", even, MaskSpec.of(prim("dilated", max(2, even[0] + 2), 2, 1))),
        (
            "zigzag",
            even,
            MaskSpec.of(
                or_(
                    prim("blocks", 5, ((0, 0), (1, 0), (2, 1), (3, 3), (4, 2))),
                    and_(prim("inverse-causal"), prim("window", 0, 3)),
                )
            ),
        ),
        (
            "striped",
            even,
            MaskSpec.of(
                and_(
                    prim("document", tuple(sorted({0, total // 3, total // 2 + 1}))),
                    not_(prim("prefix", 2)),
                    prim("full"),
                )
            ),
        ),
        ("contiguous", idle, MaskSpec.of(and_(prim("prefix", first), prim("inverse-causal")))),
        (
            "zigzag",
            idle,
            MaskSpec.of(Expr("per-document", (docs,), (or_(prim("causal"), prim("chunked", 3)),))),
        ),
    ]


def battery_pool_size(cases: list[Case]) -> int:
    """Ranks a pool needs to run every case without restarting."""
    return max(c.pool_size for c in cases)


__all__ = ["Case", "default_battery", "battery_pool_size"]
