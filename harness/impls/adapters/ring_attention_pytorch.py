"""lucidrains' `ring-attention-pytorch`: its pure-PyTorch `ring_flash_attn` in ring mode.

How the library is driven (read from its source, version 0.5.x):
- tensors are (batch, seq, heads, dim) like ours; kv heads are expanded with einops
  '... h d -> ... (g h) d' (query head i uses kv head i % kv_heads, "tiled"), while the harness uses
  the grouped convention (query head i uses kv head i // G), so query heads are permuted in and out;
- the softmax scale is fixed at head_dim ** -0.5, so q is multiplied by scale * sqrt(head_dim)
  (autograd carries that factor into dq);
- `ring_reduce_col=True` is ring mode; `striped_ring_attn=True` masks causally for the striped
  layout (token i on rank i mod W); `ring_size=W`;
- `bucket_size` = the local length: one bucket per rank, so the causal bucket arithmetic (which
  compares bucket indices, and for striping assumes one bucket per rank) is exact;
- peers are global ranks of the default group (`dist.get_rank()`, cached) and every hop ends with
  a world `dist.barrier()`: it cannot run in a subgroup, so the adapter refuses one;
- the ring sends equal-shaped buffers: no uneven splits; W=1 sends to itself, which gloo refuses;
- its row statistics are float32 while o stays in the input dtype, and half inputs fail with a
  dtype mismatch in einsum: fp32 only.
"""

from __future__ import annotations

import warnings

import torch

from harness.context import Capabilities, Impl, RunContext
from harness.impls.adapters._common import (
    Variant,
    grouped_to_tiled,
    installed_version,
    q_prescale,
    require_supported,
    require_whole_world,
    tiled_to_grouped,
    variant,
)

EXTRA = "ring-attention-pytorch"
VARIANTS = {
    "ring-attention-pytorch": Variant(
        Capabilities(
            layouts=frozenset({"contiguous", "striped"}),
            masks=frozenset({"none", "causal"}),
            dtypes=frozenset({"fp32"}),
            gqa=True,
            uneven=False,
            world_sizes=(2, 8),
            backward=True,
            devices=frozenset({"cpu", "cuda"}),
            returns_lse=False,
            subgroups=False,  # addresses peers by global rank and barriers on the whole world
        )
    ),
}


def library_args(ctx: RunContext, local_len: int) -> dict:
    """Keyword arguments for `ring_flash_attn` that express this run (layout and mask mapping)."""
    return {
        "causal": ctx.mask.kind == "causal",
        "bucket_size": max(1, local_len),
        "ring_reduce_col": True,
        "striped_ring_attn": ctx.layout == "striped",
        "ring_size": ctx.world_size,
    }


def make(name: str) -> Impl:
    """The adapter; imports the library (ImportError when it is not installed)."""
    caps = variant(VARIANTS, name).capabilities
    with warnings.catch_warnings():  # its beartype hints warn on import (PEP 585 deprecations)
        warnings.simplefilter("ignore", DeprecationWarning)
        from ring_attention_pytorch import distributed as lib_dist
        from ring_attention_pytorch import ring_flash_attn

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k)
        require_whole_world(name, ctx)
        # its rank / world size are lru-cached on first use; read them fresh for this process group
        lib_dist.get_rank.cache_clear()
        lib_dist.get_world_size.cache_clear()
        kv_heads = k.shape[2]
        qs = grouped_to_tiled(q * q_prescale(ctx.softmax_scale, q.shape[-1]), kv_heads)
        out = ring_flash_attn(qs, k, v, **library_args(ctx, q.shape[1]))
        return tiled_to_grouped(out, kv_heads)

    return Impl(
        name=name, run=run, capabilities=caps, version=installed_version("ring-attention-pytorch")
    )
