"""NVIDIA Transformer Engine's context parallelism: `DotProductAttention` + `set_context_parallel_group`.

`DotProductAttention(num_attention_heads, kv_channels, num_gqa_groups=, attention_dropout=,
qkv_format="bshd", attn_mask_type=, window_size=, softmax_scale=)` then
`set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)` with cp_comm_type
"p2p" (KV ring), "a2a" (Ulysses-style head scatter) or "all_gather". The load-balancing strategy is
dual-chunk swap: the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r (TE's
tests: `index_select(seq, [rank, 2W-1-rank])`), i.e. our "zigzag", so chunks must be equal: the
total length divisible by 2W. TE's window (left, right) is relative to the bottom-right-aligned
diagonal; our window mask is `attn_mask_type="causal"`, `window_size=(w, 0)`. TE's own tests skip
sliding windows with p2p; a2a needs head counts divisible by W. Output is (batch, seq, heads*dim).
"""

from __future__ import annotations

import torch

from harness.context import Capabilities, Impl, RunContext
from harness.errors import ImplError
from harness.impls.adapters._common import (
    FLASH_HEAD_DIMS,
    Variant,
    installed_version,
    require_supported,
    variant,
)

EXTRA = "te"


def _caps(masks: set[str]) -> Capabilities:
    return Capabilities(
        layouts=frozenset({"zigzag"}),
        masks=frozenset(masks),
        dtypes=frozenset({"fp16", "bf16"}),
        gqa=True,
        uneven=False,
        world_sizes=(1, 8),
        backward=True,
        backends=frozenset({"nccl"}),
        returns_lse=False,
        head_dims=FLASH_HEAD_DIMS,
    )


# option: TE's cp_comm_type
VARIANTS = {
    "te-cp-p2p": Variant(_caps({"none", "causal"}), option="p2p"),
    "te-cp-a2a": Variant(_caps({"none", "causal", "window"}), option="a2a"),
    "te-cp-all-gather": Variant(_caps({"none", "causal", "window"}), option="all_gather"),
}


def mask_args(ctx: RunContext) -> dict:
    """TE's attn_mask_type and window_size for our mask."""
    if ctx.mask.kind == "none":
        return {"attn_mask_type": "no_mask", "window_size": (-1, -1)}
    if ctx.mask.kind == "causal":
        return {"attn_mask_type": "causal", "window_size": (-1, 0)}
    if ctx.mask.kind == "window":
        return {"attn_mask_type": "causal", "window_size": (int(ctx.mask.window), 0)}
    raise ImplError(f"te-cp: mask {ctx.mask.kind} has no TE equivalent here")


def check_shapes(name: str, ctx: RunContext, heads_q: int, heads_kv: int) -> None:
    """TE's own preconditions: equal dual chunks; a2a scatters heads over the ranks."""
    if ctx.total_len % (2 * ctx.world_size):
        raise ImplError(
            f"{name}: total length {ctx.total_len} is not divisible by 2*W = {2 * ctx.world_size}"
        )
    if variant(VARIANTS, name).option == "a2a" and (heads_q % ctx.world_size or heads_kv % ctx.world_size):
        raise ImplError(
            f"{name}: a2a needs head counts divisible by W={ctx.world_size} "
            f"(got {heads_q} query, {heads_kv} kv heads)"
        )


def make(name: str) -> Impl:
    """TE's DotProductAttention with the variant's cp_comm_type; imports TE (ImportError when absent)."""
    declared = variant(VARIANTS, name)
    from transformer_engine.pytorch import DotProductAttention

    comm, caps = declared.option, declared.capabilities
    modules: dict[tuple, torch.nn.Module] = {}

    def module_for(ctx: RunContext, q: torch.Tensor, k: torch.Tensor) -> torch.nn.Module:
        key = (
            id(ctx.group),
            tuple(ctx.global_ranks),
            q.shape[2],
            k.shape[2],
            q.shape[3],
            ctx.softmax_scale,
            ctx.mask.to_dict().__repr__(),
        )
        if key not in modules:
            m = DotProductAttention(
                q.shape[2],
                q.shape[3],
                num_gqa_groups=k.shape[2],
                attention_dropout=0.0,
                qkv_format="bshd",
                softmax_scale=ctx.softmax_scale,
                **mask_args(ctx),
            )
            m.set_context_parallel_group(ctx.group, list(ctx.global_ranks), torch.cuda.Stream(), comm)
            modules[key] = m.to(ctx.device)
        return modules[key]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k)
        check_shapes(name, ctx, q.shape[2], k.shape[2])
        out = module_for(ctx, q, k)(q, k, v)
        return out.view(q.shape)

    return Impl(
        name=name,
        run=run,
        capabilities=caps,
        version=installed_version("transformer-engine"),
        deterministic=False,
    )


def dual_chunk_positions(total: int, world_size: int, rank: int) -> torch.Tensor:
    """Global positions TE's dual-chunk-swap sharding gives `rank` (its tests' index_select)."""
    pos = torch.arange(total).view(2 * world_size, total // (2 * world_size))
    return pos.index_select(0, torch.tensor([rank, 2 * world_size - rank - 1])).reshape(-1)
