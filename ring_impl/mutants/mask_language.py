"""Mutants of the mask language's bug classes (issue #16): masks decided from a rank's local
indices where global positions were meant, a prefix boundary off by one, and rows or ranks that
see nothing."""

from __future__ import annotations

import torch

from ring_impl.kernel import block_forward
from ring_impl.mask_eval import Leaf, evaluate
from ring_impl.masks import Expr, MaskSpec, prim
from ring_impl.mutants.base import mask_changes, mutant
from ring_impl.ring import BlockAt, position_mask


def _with_leaves(ops: tuple[str, ...], leaf: Leaf, remote_only: bool = False):
    """A block mask that evaluates the primitives named `ops` with `leaf` (the rest from global
    positions)."""

    def block_mask(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt):
        e = spec.expression()
        if not any(x.op in ops for x in e.leaves()) or (remote_only and at.owner == at.rank):
            return position_mask(spec, q_pos, k_pos, at)
        return evaluate(
            e,
            q_pos.view(-1, 1),
            k_pos.view(1, -1),
            lambda x, qp, kp: leaf(x, qp, kp) if x.op in ops else None,
        ).contiguous()

    return block_mask


def _local(qp: torch.Tensor, kp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's local token indices (0 .. L-1 on its rank) in place of global positions."""
    return (
        torch.arange(qp.shape[0], device=qp.device).view(-1, 1),
        torch.arange(kp.shape[1], device=kp.device).view(1, -1),
    )


def _on_local_indices(e: Expr, qp: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
    return evaluate(e, *_local(qp, kp))


def _dilation_phase_local(e: Expr, qp: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
    seg, rate, off = e.params
    lq, lk = _local(qp, kp)
    return ((qp // seg) == (kp // seg)) & ((lq % seg) % rate == off) & ((lk % seg) % rate == off)


def _prefix_inclusive(e: Expr, qp: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
    return evaluate(prim("prefix", e.param("length") + 1), qp, kp)


def nan_for_rows_that_see_nothing(q, k, v, scale, mask=None, **kw):
    """The block kernel without the empty-row guard: a row that sees no key of the block divides 0
    by 0."""
    out, lse = block_forward(q, k, v, scale, mask, **kw)
    empty = torch.isinf(lse).transpose(1, 2).unsqueeze(-1)  # (B, Lq, Hq, 1)
    return out.masked_fill(empty, float("nan")), lse


def uninitialised_output(
    q: torch.Tensor, v: torch.Tensor, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank none of whose queries sees a key returns its output buffer as allocated (modelled as
    NaN, what uninitialised memory may hold, so the bug replays bit for bit)."""
    b, n, h, _ = q.shape
    return (
        q.new_full(q.shape[:3] + (v.shape[-1],), float("nan"), dtype=acc),
        q.new_full((b, h, n), float("-inf"), dtype=acc),
    )


window_without_block_offset = mutant(
    "window-without-block-offset",
    """Passes the sliding window to every ring step in local indices, without the block's offset, as
    ring-flash-attn's ring functions pass `window_size` to each step's flash-attn call (zhuzilin/
    ring-flash-attention#35; accelerate PR #4177 refuses CP for sliding-window layers because CP silently
    dropped those masks). The rank's own block is right. Visible for window masks with W >= 2 whenever a
    window reaches into another rank's keys.""",
    **mask_changes(_with_leaves(("window",), _on_local_indices, remote_only=True)),
)

chunked_local_chunk_ids = mutant(
    "chunked-local-chunk-ids",
    """Chunked local attention (Llama 4: a query sees only the keys of its own chunk) with chunk ids from
    each rank's local token index instead of the global position, as a per-rank `pos // chunk` on
    locally numbered tokens gives (no single public report; accelerate PR #4177 refuses CP for chunked
    layers because CP silently dropped the mask). Visible for chunked masks when a shard does not start on a multiple of
    the chunk size, or a chunk spans ranks.""",
    **mask_changes(_with_leaves(("chunked",), _on_local_indices)),
)

dilation_offset_reset_per_rank = mutant(
    "dilation-offset-reset-per-rank",
    """Dilated (LongNet-style) attention whose dilation grid restarts on every rank: the offset
    (position mod segment) mod rate is taken from the local token index, the segments from global
    positions (no single public report we can cite by number; a report on dilated ring attention names
    "shape mismatches when applying dilated patterns across chunks"). Visible for dilated masks with
    rate >= 2 when a shard does not start on the grid.""",
    **mask_changes(_with_leaves(("dilated",), _dilation_phase_local)),
)

prefix_off_by_one = mutant(
    "prefix-off-by-one",
    """Prefix-LM boundary off by one: keys k <= n treated as the prefix instead of k < n, so every query
    sees the first key after the prefix (a `<` vs `<=` slip, no single public report; prefix-LM masks are
    in production models).
    Visible for prefix masks whenever some query may not otherwise see key n.""",
    **mask_changes(_with_leaves(("prefix",), _prefix_inclusive)),
)

nan_on_empty_row = mutant(
    "nan-on-empty-row",
    """A block kernel that returns NaN for a query row that sees no key of the block (0/0 in the
    softmax), which the merge then carries into rows that do see keys elsewhere (0 * NaN): the rows left
    undefined when seq_q > seq_k with causal in flash-attn (Dao-AILab/flash-attention#1778), and
    Megatron-LM #1764 (CP NaN loss when a rank's tokens are all masked). Visible whenever a computed block
    has a row that sees none of its keys: causal zigzag already, and every mask with empty rows.""",
    block_forward=nan_for_rows_that_see_nothing,
)

idle_rank_output_uninitialised = mutant(
    "idle-rank-output-uninitialised",
    """A rank that computes no block (every query of it sees nothing) returns its output buffer
    uninitialised instead of zeros (MagiAttention PR #9/#17: an idle rank's uninitialised output leaks
    NaN). Visible when some rank holds tokens none of which sees any key (a rank with no token at all
    has nothing to return).""",
    no_blocks=uninitialised_output,
)
