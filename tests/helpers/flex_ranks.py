"""Rank side of tests/impls/test_torch_flex_cp.py: torch's flex CP forward (the `torch-flex-cp`
adapter's `forward`, eager) on CPU gloo ranks, `python -m tests.helpers.flex_ranks RANK WORLD DIR`.
Every rank runs every case of `cases(world)` and saves its (out, lse) per case to DIR/rank{RANK}.pt
for the parent to judge.

float64 on the ranks, from float32 inputs (what the oracle's exact side takes), so the comparison
with the oracle is exact up to float64 rounding. Only the forward: flex_attention has no CPU
backward.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch

from harness.context import RunContext
from ring_impl.layouts import all_positions, shard
from ring_impl.masks import Expr, MaskSpec, and_, not_, or_, prim

HEADS_Q, HEADS_KV, HEAD_DIM, BATCH = 4, 2, 8, 2


def cases(world_size: int) -> list[tuple[str, int, MaskSpec]]:
    """(layout, tokens per rank, mask): every layout, the original kinds, every primitive, the
    combinators, a two-sided window, rows that see nothing (the dilation's off-grid queries) and
    per-document masks."""
    n = 6 * world_size
    docs = (0, 5, n // 2 + 1)
    masks = [
        MaskSpec("none"),
        MaskSpec("causal"),
        MaskSpec("window", window=4),
        MaskSpec("document", doc_starts=docs, causal=True),
        MaskSpec.of(prim("window", 3, 2)),
        MaskSpec.of(or_(prim("chunked", 5), prim("prefix", 2))),
        MaskSpec.of(prim("dilated", 6, 2, 1)),
        MaskSpec.of(and_(prim("inverse-causal"), not_(prim("blocks", 4, ((1, 2), (0, 3)))))),
        MaskSpec.of(Expr("per-document", (docs,), (and_(prim("causal"), prim("chunked", 3)),))),
    ]
    return [(layout, 6, m) for layout in ("contiguous", "zigzag", "striped") for m in masks]


def inputs(total: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global q, k, v (batch, seq, heads, dim), float32 values."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, total, HEADS_Q, HEAD_DIM, generator=g)
    k, v = (torch.randn(BATCH, total, HEADS_KV, HEAD_DIM, generator=g) for _ in range(2))
    return q, k, v


SCALE = 0.4


def main(rank: int, world_size: int, out_dir: Path) -> None:
    import torch.distributed as dist

    from harness.impls.adapters.torch_flex_cp import forward

    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir / 'store'}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    results = []
    for i, (layout, per_rank, mask) in enumerate(cases(world_size)):
        lengths = (per_rank,) * world_size
        q, k, v = inputs(sum(lengths), seed=i)
        ctx = RunContext(
            group=dist.group.WORLD,
            rank=rank,
            world_size=world_size,
            global_ranks=tuple(range(world_size)),
            layout=layout,
            lengths=lengths,
            all_positions=tuple(all_positions(layout, list(lengths))),
            mask=mask,
            softmax_scale=SCALE,
            dtype=torch.float64,
            device=torch.device("cpu"),
        )
        local = [shard(t, layout, list(lengths), rank).double() for t in (q, k, v)]
        results.append(forward(*local, ctx, compiled=False))
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
