"""Helpers shared by the adapters: refusing what an implementation does not support, versions,
tensor layout conversions. Imports torch and the harness only, never a third-party library."""

from __future__ import annotations

import importlib.metadata as md

import torch

from harness.context import Capabilities, RunContext
from harness.impls.registry import ImplError

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FLASH_HEAD_DIMS = tuple(range(8, 257, 8))  # flash-attn 2 / cuDNN fused attention: multiples of 8 up to 256


def installed_version(dist_name: str) -> str:
    """The installed distribution's version, or 'unknown' when it has no metadata."""
    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return "unknown"


def backend_of(ctx: RunContext) -> str:
    """'nccl' for CUDA tensors, 'gloo' otherwise (how the harness pairs devices and backends)."""
    return "nccl" if ctx.device.type == "cuda" else "gloo"


def is_uneven(ctx: RunContext) -> bool:
    return len(set(int(n) for n in ctx.lengths)) > 1


def unsupported(ctx: RunContext, caps: Capabilities, q: torch.Tensor, k: torch.Tensor) -> list[str]:
    """What this run asks for that `caps` does not declare (empty when everything is supported)."""
    why = []
    if ctx.layout not in caps.layouts:
        why.append(f"layout {ctx.layout}")
    if ctx.mask.kind not in caps.masks:
        why.append(f"mask {ctx.mask.kind}")
    name = DTYPE_NAMES.get(q.dtype, str(q.dtype))
    if name not in caps.dtypes:
        why.append(f"dtype {name}")
    if not caps.gqa and q.shape[2] != k.shape[2]:
        why.append(f"GQA ({q.shape[2]} query heads, {k.shape[2]} kv heads)")
    if not caps.uneven and is_uneven(ctx):
        why.append(f"uneven split {list(ctx.lengths)}")
    lo, hi = caps.world_sizes
    if not lo <= ctx.world_size <= hi:
        why.append(f"world size {ctx.world_size} (supports {lo}..{hi})")
    backend = backend_of(ctx)
    if backend not in caps.backends:
        why.append(f"backend {backend} (supports {', '.join(sorted(caps.backends))})")
    if caps.head_dims is not None and q.shape[-1] not in caps.head_dims:
        why.append(f"head_dim {q.shape[-1]}")
    return why


def require_supported(
    name: str, ctx: RunContext, caps: Capabilities, q: torch.Tensor, k: torch.Tensor
) -> None:
    """Refuse, with one line, a run outside the declared capabilities.

    Refusing is better than calling the library: out-of-contract inputs can hang a ring (mismatched
    send/recv sizes) or return silently wrong numbers. Probing a library outside its contract is a
    separate, deliberate experiment, not something an adapter does by accident.
    """
    why = unsupported(ctx, caps, q, k)
    if why:
        raise ImplError(f"{name}: unsupported here: {'; '.join(why)}")


def require_whole_world(name: str, ctx: RunContext) -> None:
    """For libraries that address peers by global rank in the default group (and barrier on it)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != ctx.world_size or tuple(ctx.global_ranks) != tuple(range(ctx.world_size)):
        raise ImplError(
            f"{name}: runs only on the whole default process group (global ranks 0..{world - 1}); "
            f"this ring is global ranks {list(ctx.global_ranks)} of {world}"
        )


def to_bhsd(t: torch.Tensor) -> torch.Tensor:
    """(batch, seq, heads, dim) -> (batch, heads, seq, dim), as SDPA and torch's ring want."""
    return t.transpose(1, 2)


def grouped_to_tiled(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Reorder query heads from the grouped GQA convention to the tiled one.

    Grouped (flash-attn, SDPA enable_gqa, the oracle): query head i uses kv head i // G.
    Tiled (einops '... h d -> ... (g h) d'): query head i uses kv head i % kv_heads.
    Grouped head (h, g) = h*G + g goes to tiled position g*kv_heads + h.
    """
    b, n, heads, d = q.shape
    if heads == kv_heads:
        return q
    g = heads // kv_heads
    return q.reshape(b, n, kv_heads, g, d).transpose(2, 3).reshape(b, n, heads, d)


def tiled_to_grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of `grouped_to_tiled` (for outputs, which carry query heads)."""
    b, n, heads, d = x.shape
    if heads == kv_heads:
        return x
    g = heads // kv_heads
    return x.reshape(b, n, g, kv_heads, d).transpose(2, 3).reshape(b, n, heads, d)
