"""Mutants in which blocks are computed and how they are masked."""

from __future__ import annotations

import dataclasses

import torch

from ring_impl import layouts
from ring_impl.mask_eval import allowed
from ring_impl.masks import MaskSpec
from ring_impl.mutants.base import mask_changes, mutant
from ring_impl.ring import BlockAt, position_mask, skip_empty_block


def step_rule_off_by_one(
    spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt
) -> bool:
    """Causal ring rule "compute step s iff s <= rank" written as s < rank: owner 0's block is
    dropped."""
    if spec.kind == "causal" and at.step > 0:
        return not at.step < at.rank
    return skip_empty_block(spec, q_pos, k_pos, at)


def diagonal_on_every_step(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt):
    """Applies the diagonal block's local-index causal triangle to every block."""
    m = position_mask(spec, q_pos, k_pos, at)
    if not spec.is_causal:
        return m
    tri = torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool, device=q_pos.device).tril()
    return tri if m is None else m & tri


def striped_same_stripe_visible(
    spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt
):
    """Striped causal comparing stripe indices only: tril(0) on every block; later owners need
    tril(-1)."""
    if at.layout != "striped" or spec.kind != "causal":
        return position_mask(spec, q_pos, k_pos, at)
    return (k_pos // at.world_size).view(1, -1) <= (q_pos // at.world_size).view(-1, 1)


def window_one_wider(spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt):
    """Sliding window with `<` where `<=` was meant: each query sees one key too many."""
    if spec.kind == "window":
        spec = dataclasses.replace(spec, window=spec.window + 1)
    return position_mask(spec, q_pos, k_pos, at)


def documents_only_on_diagonal(
    spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt
):
    """Document boundaries only inside the local block (local cu_seqlens); remote blocks are causal
    only."""
    if spec.kind != "document" or at.owner == at.rank:
        return position_mask(spec, q_pos, k_pos, at)
    return allowed(MaskSpec("causal"), q_pos, k_pos) if spec.causal else None


def zigzag_second_half_in_rank_order(layout: str, lengths) -> list[torch.Tensor]:
    """Zigzag positions with the second-half chunks in rank order (W..2W-1 on ranks 0..W-1), not
    reversed."""
    if layout != "zigzag":
        return layouts.all_positions(layout, lengths)
    w = len(lengths)
    chunks = layouts.zigzag_chunks(lengths)
    chunks = chunks[:w] + chunks[w:][::-1]  # bug: undoes the reversal of the second half
    parts: list[list[torch.Tensor]] = [[] for _ in range(w)]
    start = 0
    for r, size in chunks:
        parts[r].append(torch.arange(start, start + size, dtype=torch.long))
        start += size
    return [torch.cat(p) for p in parts]


causal_step_off_by_one = mutant(
    "causal-step-off-by-one",
    """Causal ring that picks the steps to compute by step index with `step < rank` instead of the
    `step <= rank` of ring-flash-attention's contiguous causal ring, dropping owner 0's block on
    every rank >= 1. Visible for causal masks with W >= 2 (on ranks >= 1; any layout, since the
    step rule ignores positions).""",
    skip_block=step_rule_off_by_one,
)

diagonal_mask_every_step = mutant(
    "diagonal-mask-every-step",
    """Applies the causal diagonal (local-index triangle) on every ring step instead of only on the
    rank's own block (ring-flash-attention passes `causal=causal and step == 0`). Visible for
    causal-type masks with W >= 2.""",
    **mask_changes(diagonal_on_every_step),
)

striped_diagonal_offset = mutant(
    "striped-diagonal-offset",
    """Striped causal mask with the wrong diagonal offset: blocks from later ranks use tril(0) instead
    of tril(-1), so a query sees the same-stripe key of later ranks (the offset rule of Striped
    Attention, Brandon et al. 2023). Visible for striped + causal with W >= 2.""",
    **mask_changes(striped_same_stripe_visible),
)

window_off_by_one = mutant(
    "window-off-by-one",
    """Sliding window one key too wide (i - window - 1 <= j), a `<` vs `<=` slip (no single public
    report). Visible for window masks whenever a query has a key exactly window + 1 behind it.""",
    **mask_changes(window_one_wider),
)

document_leak_across_ranks = mutant(
    "document-leak-across-ranks",
    """Document (packed varlen) mask applied only within the local block, as with per-rank cu_seqlens
    (no single public report); a document boundary between two ranks' tokens leaks: queries see
    earlier documents' keys held by other ranks. Visible for document masks with such a boundary.""",
    **mask_changes(documents_only_on_diagonal),
)

zigzag_second_half_order = mutant(
    "zigzag-second-half-order",
    """Believes rank r holds zigzag chunks r and W + r (second half in rank order) rather than
    2W - 1 - r, so masks use the wrong global positions for the second half (the layout of
    ring-flash-attention's zigzag ring; no single public report). Visible for zigzag with a
    position-dependent mask and W >= 2.""",
    positions=zigzag_second_half_in_rank_order,
)
