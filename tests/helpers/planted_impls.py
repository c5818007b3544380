"""A planted bug for the property-based tests (loaded as tests.helpers.planted_impls:NAME).

`late_diagonal`: from ring step 2 on, the causal diagonal is one token late (key q + 1 is visible
to query q). At W = 2 the only block past the diagonal arrives at step 1, so the bug needs W >= 3
to show; the smallest failing case is W = 3 with one token per rank.

`two_bugs`: two unrelated bugs with different signatures (a causality leak alone on masked cases; dq
alone at head_dim 1), for shrinking that keeps each failure's signature.
"""

from __future__ import annotations

from dataclasses import replace

from harness.context import Impl
from ring_impl.kernel import block_backward
from ring_impl.mask_eval import allowed, block_is_empty
from ring_impl.ring import REFERENCE_PARTS, make_ring_attention, position_mask, skip_empty_block


def _late(spec, q_pos, at) -> bool:
    return at.step >= 2 and spec.is_causal


def _late_mask(spec, q_pos, k_pos, at):
    return (
        allowed(spec, q_pos + 1, k_pos)
        if _late(spec, q_pos, at)
        else position_mask(spec, q_pos, k_pos, at)
    )


def _late_skip(spec, q_pos, k_pos, at) -> bool:
    if _late(spec, q_pos, at):
        return block_is_empty(spec, q_pos + 1, k_pos)
    return skip_empty_block(spec, q_pos, k_pos, at)


_ring = make_ring_attention(replace(REFERENCE_PARTS, block_mask=_late_mask, skip_block=_late_skip))


def _run(q, k, v, ctx):
    return _ring(
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


late_diagonal = Impl("planted-late-diagonal", _run)


def _dq_off_when_head_dim_is_one(grad, dtype):
    """Bug B: dq 1.5x too large when head_dim is 1 (any W, mask, layout): fails dq alone."""
    return (grad * 1.5 if grad.shape[-1] == 1 else grad).to(dtype)


def _masked_blocks_leak(dout, q, k, v, out, lse, scale, mask=None, **kw):
    """Bug A: every key of every computed block gets dk += 1e-30, hidden or not: far inside the
    tolerance, but on a masked case the exact leak check sees it (a causality leak and nothing else;
    a case without a mask has no leak check). Not keyed on the block's mask: a block every query of
    which sees every key is computed without one (`block_decision` FULL)."""
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale, mask, **kw)
    return dq, dk + 1e-30, dv


_two = make_ring_attention(
    replace(
        REFERENCE_PARTS, block_backward=_masked_blocks_leak, cast_dq=_dq_off_when_head_dim_is_one
    )
)


def _run_two(q, k, v, ctx):
    return _two(
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


# two failures with different signatures: a leak alone (masked cases) and dq alone (head_dim 1); a
# masked case with head_dim 1 fails both ways, a third signature
two_bugs = Impl("planted-two-bugs", _run_two)
