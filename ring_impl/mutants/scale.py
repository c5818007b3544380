"""Mutants that are right at toy sizes and wrong only at the sizes models train with.

Each is bit-identical to the reference while every rank holds at most one 64-token tile, every
position fits the input dtype's exact integers (256 in bf16, 2048 in fp16) and head_dim <= 64: what
the battery, the growth check and the toy property sizes ran before the scale stage. The scale stage
(harness/search/scale.py) aims at exactly these edges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from ring_impl.kernel import TileMask, block_backward, block_forward
from ring_impl.mutants.base import mutant

KEY_TILE = 64  # the key tile of the kernels below
BUCKET = 64  # the largest head dim of the kernel the backward below dispatches to


def _full_tiles(n: int) -> int:
    """Keys a kernel visits with `n // KEY_TILE` key tiles (floor, not ceil) when the block is over
    one tile."""
    return n if n <= KEY_TILE else n // KEY_TILE * KEY_TILE


def _cut(mask, lk: int):
    """The block's mask for its first `lk` keys."""
    if mask is None:
        return None
    if isinstance(mask, TileMask):
        return TileMask(mask.fn, (mask.shape[0], lk))
    return mask[:, :lk]


def tail_dropping_forward(q, k, v, scale, mask=None, **kwargs):
    lk = _full_tiles(k.shape[1])
    return block_forward(q, k[:, :lk], v[:, :lk], scale, _cut(mask, lk), **kwargs)


def tail_dropping_backward(dout, q, k, v, out, lse, scale, mask=None, **kwargs):
    lk = _full_tiles(k.shape[1])
    dq, dk, dv = block_backward(
        dout, q, k[:, :lk], v[:, :lk], out, lse, scale, _cut(mask, lk), **kwargs
    )
    pad = (0, 0, 0, 0, 0, k.shape[1] - lk)  # the dropped keys get no gradient
    return dq, F.pad(dk, pad), F.pad(dv, pad)


def positions_in_dtype(pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positions made in the input dtype (`torch.arange(n, dtype=q.dtype)`), then used as
    integers."""
    return pos.to(dtype).to(pos.dtype)


def backward_via_small_kernel(dout, q, k, v, out, lse, scale, mask=None, **kwargs):
    """Above BUCKET, the backward runs the BUCKET kernel: it reads only the first BUCKET features of
    q and k."""
    d = q.shape[-1]
    if d <= BUCKET:
        return block_backward(dout, q, k, v, out, lse, scale, mask, **kwargs)
    keep = (torch.arange(d, device=q.device) < BUCKET).to(q.dtype)
    return block_backward(dout, q * keep, k * keep, v, out, lse, scale, mask, **kwargs)


tile_tail_dropped = mutant(
    "tile-tail-dropped",
    """The block kernel visits keys in 64-token tiles and counts them with floor division, so a block
    of more than 64 keys that is not a multiple of 64 loses its last partial tile, in forward and
    backward alike (flash-attn-style kernels with seqlen_k % block != 0: pytorch/pytorch#159247, flex
    attention with a kv length not a multiple of its 128 block; flashinfer#5090, seqlen_k % 64 != 0;
    jax#27224). Visible when a rank holds more than 64 tokens, not a multiple of 64; exact at <= 64.""",
    block_forward=tail_dropping_forward,
    block_backward=tail_dropping_backward,
)

positions_in_input_dtype = mutant(
    "positions-in-input-dtype",
    """Global positions are made in the input dtype and the masks compare those: bf16 holds every
    integer only up to 256 (257 rounds to 256, 259 to 260), fp16 up to 2048, so from there a query sees
    a future key or misses one (GPT-NeoX#1016: "we cannot distinguish 256.0 and 257.0" in bf16
    positions; transformers#29285). Visible with a mask and positions beyond 256 (bf16) or 2048 (fp16);
    exact below, and for fp32.""",
    position_values=positions_in_dtype,
)

head_dim_dispatch_slip = mutant(
    "head-dim-dispatch-slip",
    """Kernels are compiled per head-dim bucket; the backward dispatches head dims above 64 to the
    64 kernel, which recomputes the scores from the first 64 features of q and k. The forward is right,
    the gradients are not (flash-attn#1306: head dim 256 backward mismatch; TransformerEngine#3216:
    wrong dQ/dK/dV at head_dim 256 with a correct forward; pytorch/pytorch#94921: SDPA dispatched
    flash backward where head_size 128 was unsupported). Visible at head_dim > 64 (80, 96, 128, ...);
    exact at <= 64.""",
    block_backward=backward_via_small_kernel,
)
