"""Mutants of how a model calls a ring and what it hands it (issue #40).

Each is right on a plain training call with fresh contiguous unit-scale inputs, so only the calls,
input forms and value kinds of `harness.calls` and `harness.inputs` show it:

- `no-grad-path-causal-by-rank`: a separate forward-only path, taken when no gradient is recorded;
- `q-scaled-in-place`: the caller's q scaled in place, so a checkpoint's recompute scales it twice;
- `inputs-assumed-contiguous`, `dout-assumed-contiguous`: strides assumed, views read wrongly;
- `qk-product-in-input-dtype`: q.k formed in fp16 before the scale, so it overflows on trained
  values.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ring_impl.kernel import block_forward
from ring_impl.masks import MaskSpec
from ring_impl.mutants.base import mutant
from ring_impl.ring import (
    REFERENCE_PARTS,
    BlockAt,
    _RingAttention,
    make_ring_attention,
    plan_call,
    ring_attention,
    skip_empty_block,
)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def _as_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage read with the strides a contiguous tensor of its shape would have."""
    return t.as_strided(t.shape, _contiguous_strides(t.shape), t.storage_offset())


def skip_by_rank_order(
    spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt
) -> bool:
    """Under a causal mask, skip every block owned by a later rank: right for the contiguous layout
    only."""
    if spec.is_causal and at.owner > at.rank:
        return True
    return skip_empty_block(spec, q_pos, k_pos, at)


_fast_forward = make_ring_attention(
    dataclasses.replace(REFERENCE_PARTS, skip_block=skip_by_rank_order)
)


def no_grad_path_causal_by_rank(q, k, v, **kw: Any):
    """Serving and evaluation take a forward-only path when no gradient is recorded (torch.no_grad,
    inference_mode, the first forward of reentrant checkpointing). Its causal block skipping goes by
    rank order, as a contiguous split allows, so zigzag and striped rows lose the blocks of later
    ranks. The training path is the reference. There is no single public report: serving stacks keep
    prefill paths apart from training, and the harness never ran them before. Visible on
    forward-only calls of a causal zigzag or striped ring."""
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return (ring_attention if recording else _fast_forward)(q, k, v, **kw)


class _QScaledInPlace(torch.autograd.Function):
    """The reference ring on a copy of q, which then writes the scaled q back into the caller's
    tensor."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        q0 = q.detach().clone()
        q.mul_(plan.scale)  # the bug: the caller's q holds the scaled q from now on
        return _RingAttention.forward(ctx, q0, k, v, None, REFERENCE_PARTS, plan)

    @staticmethod
    def backward(ctx, dout, dlse):
        return *_RingAttention.backward(ctx, dout, dlse)[:3], None


def q_scaled_in_place(q, k, v, *, return_lse: bool = False, **kw: Any):
    """Computes from a copy of q, then stores the scaled q in the caller's tensor (`q.mul_(scale)`:
    a buffer reused to save memory). The call's own results are right. Activation checkpointing
    calls the forward again on the same q inside backward: reentrant checkpointing recomputes from
    the scaled q, so every gradient is silently wrong; non-reentrant checkpointing sees the tensor's
    version change and raises (pytorch/pytorch documents that reentrant checkpointing does not
    detect it). Visible under `torch.utils.checkpoint` (and loud on split views of a fused
    projection, which refuse in-place writes)."""
    if {"sinks", "softcap", "alibi_slopes"} & set(kw):
        return ring_attention(q, k, v, return_lse=return_lse, **kw)  # the bug predates them
    plan, k, v = plan_call(REFERENCE_PARTS, q, k, v, **kw)
    out, lse = _QScaledInPlace.apply(q, k, v, plan)
    return (out, lse) if return_lse else out


def inputs_assumed_contiguous(q, k, v, **kw: Any):
    """Reads q, k, v through strides it assumes (`as_strided` with contiguous strides, as code that
    hands raw pointers to a kernel does). Right on contiguous tensors; on views of a fused QKV
    projection or tensors transposed from (b, h, s, d) it reads other tokens, heads or tensors,
    silently. flash-attn accepts such views (it needs only the last dimension contiguous) and passes
    their strides to its kernel. Visible on the fused-qkv and transposed input forms."""
    return ring_attention(*(_as_contiguous(t) for t in (q, k, v)), **kw)


class _GradAsContiguous(torch.autograd.Function):
    """Identity forward; its backward reads the incoming gradient with contiguous strides."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _as_contiguous(grad)


def dout_assumed_contiguous(q, k, v, *, return_lse: bool = False, **kw: Any):
    """Its backward reads dout with the strides of a contiguous tensor. Right when the model's
    gradient comes contiguous; a dout transposed from (b, h, s, d) is read as the wrong tokens and
    heads. flash-attn's backward makes such a dout contiguous first for this reason. Visible on the
    strided-dout input form."""
    out, lse = ring_attention(q, k, v, return_lse=True, **kw)
    out = _GradAsContiguous.apply(out)
    return (out, lse) if return_lse else out


def _visible(mask: Any, lq: int, lk: int) -> torch.Tensor | None:
    if mask is None or isinstance(mask, torch.Tensor):
        return mask
    return mask.tile(slice(0, lq), slice(0, lk))


def fp16_product_forward(q, k, v, scale, mask=None, *, kv_heads=None, **kw: Any):
    """The block forward, with q.k first formed in fp16 as a plain fp16 matmul does: a product past
    65504 is inf, and a row that sees one is NaN. Its rounding below that is what the base's plain
    attention does too, so only the overflow is added here."""
    out, lse = block_forward(q, k, v, scale, mask, kv_heads=kv_heads, **kw)
    if q.dtype != torch.float16 or q.shape[1] == 0 or k.shape[1] == 0:
        return out, lse
    idx = kv_heads(q.shape[2], k.shape[2]).to(q.device)
    raw = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().index_select(2, idx))
    over = raw.abs() > torch.finfo(torch.float16).max
    seen = _visible(mask, q.shape[1], k.shape[1])
    if seen is not None:
        over &= seen.to(over.device)
    rows = over.any(dim=-1)  # (B, H, Lq)
    if bool(rows.any()):
        out = out.masked_fill(rows.transpose(1, 2).unsqueeze(-1), float("nan"))
        lse = lse.masked_fill(rows, float("nan"))
    return out, lse


qk_product_in_input_dtype = mutant(
    "qk-product-in-input-dtype",
    """Forms q.k in the input dtype and scales after (a plain `(q @ k.T) * scale` in fp16). Right on unit-scale
    values; the q and k of trained models reach products past fp16's 65504 while the scaled logits stay
    finite, and then every row that sees such a key is NaN (diffusers' `upcast_attention` and HF GPT-2's
    `reorder_and_upcast_attn` upcast this product for it). Visible on fp16 cases with qk-overflow values.""",
    block_forward=fp16_product_forward,
)
