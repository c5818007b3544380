"""Deliberately broken implementations used by the harness's own tests (loaded as
tests.helpers.impls:NAME)."""

from __future__ import annotations

import os
import signal
import time

import torch

from harness.context import Capabilities, Impl
from harness.impls.adapters.reference import variant_arguments
from ring_impl import ring_attention
from ring_impl.masks import MASK_FEATURES, MaskSpec


def _reference(q, k, v, ctx):
    return ring_attention(
        q,
        k,
        v,
        group=ctx.group,
        layout=ctx.layout,
        lengths=ctx.lengths,
        mask=ctx.mask,
        softmax_scale=ctx.softmax_scale,
        **variant_arguments(ctx),
    )


def _hang(q, k, v, ctx):
    time.sleep(3600)


def _raise(q, k, v, ctx):
    raise RuntimeError(f"deliberate failure on rank {ctx.rank}")


def _segfault(q, k, v, ctx):
    """Dies of SIGSEGV inside a C call, as a backend handed a device pointer does (docs/gpu.md)."""
    import ctypes

    ctypes.string_at(0)


def _wrong_shape(q, k, v, ctx):
    return (
        _reference(q, k, v, ctx)[:, :-1] if q.shape[1] > 1 else _reference(q, k, v, ctx)[:, :, :1]
    )


def _leaky(q, k, v, ctx):
    """Ignores the case's mask: every query sees every key (a causality leak)."""
    return ring_attention(
        q,
        k,
        v,
        group=ctx.group,
        layout=ctx.layout,
        lengths=ctx.lengths,
        mask=MaskSpec("none"),
        softmax_scale=ctx.softmax_scale,
    )


def _perturbed(q, k, v, ctx):
    """The reference output plus a small constant: wrong, but only by ~1e-3."""
    return _reference(q, k, v, ctx) + 1e-3


# the reference ring under a module path (a "fixed" ring)
reference = Impl("tests-reference", _reference)
hang = Impl("tests-hang", _hang)
raises = Impl("tests-raise", _raise)
segfault = Impl("tests-segfault", _segfault)
wrong_shape = Impl("tests-wrong-shape", _wrong_shape)
leaky = Impl("tests-leaky", _leaky)
perturbed = Impl("tests-perturbed", _perturbed)


def _raise_on_rank1(q, k, v, ctx):
    """Rank 1 raises before its first send; the other ranks are already waiting in the ring for
    it."""
    if ctx.rank == 1:
        time.sleep(0.5)  # the others are blocked on their receives from rank 1 by now
        raise ValueError("deliberate shape mix-up on rank 1")
    return _reference(q, k, v, ctx)


def _hang_on_rank1(q, k, v, ctx):
    """Rank 1 never enters the ring; the others wait for it."""
    if ctx.rank == 1:
        time.sleep(3600)
    return _reference(q, k, v, ctx)


def _killed_on_rank1(q, k, v, ctx):
    """Rank 1 dies of SIGKILL as the others wait for it in the ring (an OOM killer's way)."""
    if ctx.rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    return _reference(q, k, v, ctx)


raise_on_rank1 = Impl("tests-raise-on-rank1", _raise_on_rank1)
killed_on_rank1 = Impl("tests-killed-on-rank1", _killed_on_rank1)
hang_on_rank1 = Impl("tests-hang-on-rank1", _hang_on_rank1)


# Everything the reference does but idle ranks (the default is off): the idle-rank probe must be the
# only one, and must show that the ring runs them (issue #30: a probe once also used undeclared
# masks and layouts).
no_idle = Impl(
    "tests-no-idle",
    _reference,
    capabilities=Capabilities(
        masks=frozenset(MASK_FEATURES), sinks=True, softcap=True, alibi=True, head_dim_v=True
    ),
)


# What most real rings declare: contiguous layout, masks none and causal, every dtype, GQA, uneven,
# W 1-8.
narrow = Impl(
    "tests-narrow",
    _reference,
    capabilities=Capabilities(
        layouts=frozenset({"contiguous"}), masks=frozenset({"none", "causal"})
    ),
)


# Ignores the mask, and declares what ring-attention-pytorch does: the ring is the whole world,
# W >= 2. Its cases restart the pool at their own size: the check must still plan for every rank.
whole_world_leaky = Impl(
    "tests-whole-world-leaky",
    _leaky,
    capabilities=Capabilities(
        masks=frozenset({"none", "causal"}), world_sizes=(2, 8), subgroups=False
    ),
)


_STALE: dict = {}


def _stale_accumulator(q, k, v, ctx):
    """The reference, plus a gradient buffer cached by shape across calls and never zeroed
    (ring-flash-attn 22f0e1d: "dkv_buffer was not zeroed"): the first call is exact, every later one
    adds the old dk/dv."""
    out = _reference(q, k, v, ctx)
    key = (tuple(k.shape), ctx.rank)
    buf = _STALE.setdefault(key, torch.zeros(k.shape, dtype=torch.float32))

    def hook(grad):
        buf.add_(grad.float())
        return buf.to(grad.dtype).clone()

    if k.requires_grad:  # a forward-only call has no gradient to accumulate
        k.register_hook(hook)
    return out


# declares what the reference ring under it supports (every mask, idle ranks): its bug is the state
# it keeps, and a narrower declaration would make the check probe every mask-language primitive with
# it
stale_accumulator = Impl(
    "tests-stale-accumulator",
    _stale_accumulator,
    Capabilities(masks=frozenset(MASK_FEATURES), idle_ranks=True),
)


# forward-only rings (issue #40): the reference ring's forward without autograd, as context-parallel
# prefill runs
FORWARD_ONLY = Capabilities(
    backward=False, returns_lse=True, masks=frozenset(MASK_FEATURES), idle_ranks=True
)


def _forward_only(q, k, v, ctx):
    from ring_impl import ring_attention_forward

    return ring_attention_forward(
        q,
        k,
        v,
        group=ctx.group,
        layout=ctx.layout,
        lengths=ctx.lengths,
        mask=ctx.mask,
        softmax_scale=ctx.softmax_scale,
        return_lse=True,
        **variant_arguments(ctx),
    )


def _forward_only_wrong(q, k, v, ctx):
    """The forward-only ring skipping causal blocks by rank order: wrong on zigzag and striped
    causal rows."""
    import dataclasses

    from ring_impl import REFERENCE_PARTS, make_ring_attention
    from ring_impl.mutants.calls import skip_by_rank_order

    ring = make_ring_attention(
        dataclasses.replace(REFERENCE_PARTS, skip_block=skip_by_rank_order), forward_only=True
    )
    return call_ring(ring, q, k, v, ctx)


def call_ring(ring, q, k, v, ctx):
    """`ring` called as the reference adapter calls it, lse returned, no variant."""
    return ring(
        q,
        k,
        v,
        group=ctx.group,
        layout=ctx.layout,
        lengths=ctx.lengths,
        mask=ctx.mask,
        softmax_scale=ctx.softmax_scale,
        return_lse=True,
    )


forward_only = Impl("tests-forward-only", _forward_only, capabilities=FORWARD_ONLY)
forward_only_wrong = Impl(
    "tests-forward-only-wrong", _forward_only_wrong, capabilities=FORWARD_ONLY
)
