"""The scale stage's cases: seven shapes that cross what breaks at training sizes.

The battery's toy cases never reach them. They cross kernel tile edges, the dtypes' exact integers,
the flash head dims and large head counts. docs/check.md lists them, and docs/benchmarks.md has
their cost. Each case is adapted to what an implementation declares, as the battery's are.
harness.checks.stages.scale runs them.
"""

from __future__ import annotations

from harness.case import Case, make_case
from harness.context import Capabilities
from harness.impls.capabilities import adapt
from harness.search.variants import sink_values
from ring_impl.masks import MaskSpec

TILE_MULTIPLES = (1, 2, 4)
SEED = 2900  # the stage's seeds: SEED + case index


def edge_lengths(tiles: tuple[int, ...]) -> list[int]:
    """Local lengths one token past 1, 2 and 4 tiles of each size.

    Each moves up by 2 until no tile divides it: (64, 128) -> 65, 129, 257, 513.
    """
    out = set()
    for t in tiles:
        for k in TILE_MULTIPLES:
            n = k * t + 1
            while any(n % x == 0 for x in tiles):
                n += 2
            out.add(n)
    return sorted(out)


def _docs(total: int, *starts: int) -> MaskSpec:
    return MaskSpec(
        "document", doc_starts=tuple(sorted({0, *(s for s in starts if 0 < s < total)}))
    )


def base_cases(tiles: tuple[int, ...] = (64, 128), impl: str = "reference") -> list[Case]:
    """The stage's cases before adaptation. The reference runs them as they are."""
    plan = [*_bf16_plans(edge_lengths(tiles)), *_fp16_plans(), *_fp32_plans(), *_variant_plans()]
    return [make_case(impl=impl, seed=SEED + i, **kw) for i, kw in enumerate(plan)]


def _bf16_plans(edges: list[int]) -> list[dict]:
    """bf16 cases: the tile `edges` on one ring, a window across a tile, documents past 256."""
    return [
        # every tile edge on one ring, bf16 positions up to ~1k under causal, MQA, batch 3,
        # head_dim 64
        dict(
            world_size=min(8, max(2, len(edges))),
            seq_lens=tuple((edges * 8)[: min(8, max(2, len(edges)))]),
            layout="contiguous",
            mask=MaskSpec("causal"),
            dtype="bf16",
            heads_q=2,
            heads_kv=1,
            head_dim=64,
            batch=3,
        ),
        # the shape: bf16 window crossing a tile, GQA 16/4, head_dim 128
        dict(
            world_size=4,
            seq_lens=(149, 153, 151, 157),
            layout="zigzag",
            mask=MaskSpec("window", window=100),
            dtype="bf16",
            heads_q=16,
            heads_kv=4,
            head_dim=128,
        ),
        # bf16 documents starting past 256, 32/4 heads (8:1), head_dim 80
        dict(
            world_size=4,
            seq_lens=(75, 73, 77, 71),
            layout="striped",
            mask=_docs(296, 67, 131, 257, 263, 281),
            dtype="bf16",
            heads_q=32,
            heads_kv=4,
            head_dim=80,
        ),
    ]


def _fp16_plans() -> list[dict]:
    """fp16 cases past 2048, its last exact integer: causal, a window and documents."""
    return [
        # fp16 causal past 2048 on 8 ranks of more than 4 tiles each
        dict(
            world_size=8,
            seq_lens=(261, 263, 265, 259, 267, 257, 269, 263),
            layout="contiguous",
            mask=MaskSpec("causal"),
            dtype="fp16",
            heads_q=2,
            heads_kv=1,
            head_dim=64,
        ),
        # fp16 window past 2048
        dict(
            world_size=4,
            seq_lens=(525, 527, 523, 529),
            layout="zigzag",
            mask=MaskSpec("window", window=300),
            dtype="fp16",
            heads_q=2,
            heads_kv=1,
            head_dim=32,
        ),
        # fp16 documents starting past 2048 (2049 rounds to 2048 in fp16)
        dict(
            world_size=4,
            seq_lens=(527, 523, 525, 529),
            layout="striped",
            mask=_docs(2104, 517, 1041, 2049, 2051, 2087),
            dtype="fp16",
            heads_q=2,
            heads_kv=2,
            head_dim=32,
        ),
    ]


def _fp32_plans() -> list[dict]:
    """The fp32 case: no mask, with many heads, a large batch and a flash head_dim."""
    return [
        # fp32, W = 3, GQA 8:1, batch 4, head_dim 96, no mask
        dict(
            world_size=3,
            seq_lens=(67, 71, 65),
            layout="zigzag",
            mask=MaskSpec("none"),
            dtype="fp32",
            heads_q=16,
            heads_kv=2,
            head_dim=96,
            batch=4,
        ),
    ]


def _variant_plans() -> list[dict]:
    """The attention variants at MLA's head dims (192 for q and k, 128 for v), past a tile.

    bf16, GQA 4/2, zigzag causal across 64-token tiles, sinks above the rows' lse and a cap.
    Run only by an implementation that declares every variant it uses.
    """
    lens = (67, 65, 69, 63)
    return [
        dict(
            world_size=4,
            seq_lens=lens,
            layout="zigzag",
            mask=MaskSpec("causal"),
            dtype="bf16",
            heads_q=4,
            heads_kv=2,
            head_dim=192,
            head_dim_v=128,
            sinks=sink_values("above", 4, sum(lens)),
            softcap=30.0,
        ),
    ]


def scale_cases(
    caps: Capabilities,
    impl: str = "reference",
    dtype: str | None = None,
    deadline_s: float | None = None,
) -> list[Case]:
    """The stage's cases adapted to `caps`, aimed at `caps.tiles`: one of each after adaptation.

    `dtype` runs every case in that dtype.
    """
    out: dict[str, Case] = {}
    for c in base_cases(caps.tiles, impl):
        if set(c.variants) - caps.variants:  # adapted to plain, it repeats a plain case
            continue
        if dtype is not None:
            c = c.replace(dtype=dtype)
        if deadline_s is not None:
            c = c.replace(deadline_s=deadline_s)
        a = adapt(caps, c)
        if a is not None:
            out.setdefault(a.key(), a)
    return list(out.values())


__all__ = ["base_cases", "edge_lengths", "scale_cases"]
