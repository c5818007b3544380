"""lucidrains' `ring-attention-pytorch`: its pure-PyTorch `ring_flash_attn`, in ring mode.

The adapter permutes the query heads to the library's GQA convention and folds our softmax scale
into q. It declares what the library can run: fp32 only, equal shards, no subgroup, W >= 2.
Releases before 0.5 take equal head counts only, and keep their rank helpers in `ring`, not
`distributed`: the adapter reads the installed release (ci/historical runs 0.2.10 and 0.2.11).
docs/third-party.md says how each argument is mapped, and why.
"""

from __future__ import annotations

import importlib
import re
import warnings
from dataclasses import replace

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
            # addresses peers by global rank and barriers on the whole world
            subgroups=False,
        )
    ),
}


def library_args(ctx: RunContext, local_len: int) -> dict:
    """Keyword arguments for `ring_flash_attn` that express this run's layout and mask."""
    return {
        "causal": ctx.mask.kind == "causal",
        "bucket_size": max(1, local_len),
        "ring_reduce_col": True,
        "striped_ring_attn": ctx.layout == "striped",
        "ring_size": ctx.world_size,
    }


def release(version: str) -> tuple[int, ...]:
    """'0.2.10' -> (0, 2, 10): enough to order this library's releases."""
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def make(name: str) -> Impl:
    """The adapter. It imports the library, and raises ImportError when it is not installed."""
    caps = variant(VARIANTS, name).capabilities
    version = installed_version("ring-attention-pytorch")
    old = release(version) < (0, 5)
    if old:  # before 0.5: q, k and v with the same heads
        caps = replace(caps, gqa=False)
    # its beartype hints warn on import (PEP 585 deprecations); old ones use torch.cuda.amp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        from ring_attention_pytorch import ring_flash_attn

        lib_dist = importlib.import_module(
            "ring_attention_pytorch." + ("ring" if old else "distributed")
        )

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k)
        require_whole_world(name, ctx)
        # its rank / world size are lru-cached on first use; read them fresh for this process group
        for helper in ("get_rank", "get_world_size", "is_distributed"):
            fn = getattr(lib_dist, helper, None)
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()
        kv_heads = k.shape[2]
        qs = grouped_to_tiled(q * q_prescale(ctx.softmax_scale, q.shape[-1]), kv_heads)
        out = ring_flash_attn(qs, k, v, **library_args(ctx, q.shape[1]))
        return tiled_to_grouped(out, kv_heads)

    return Impl(name=name, run=run, capabilities=caps, version=version)
