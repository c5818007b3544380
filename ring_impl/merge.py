"""The one merge of partial attention results, shared by everything that combines blocks.

Two partial results over disjoint key sets combine as a log-sum-exp weighted average. The weights
are sigmoids of the lse difference (ring-flash-attn's overflow-free form): they never exceed 1, stay
exact for huge lse (the difference, not the sum, is rounded), and -inf (no visible key) on either
side or both gives a zero weight, never NaN.
"""

from __future__ import annotations

import torch


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine (out, lse) with (block_out, block_lse): out (B, L, H, D), lse (B, H, L)."""
    both_empty = torch.isneginf(lse) & torch.isneginf(block_lse)
    diff = torch.where(both_empty, torch.zeros_like(lse), block_lse - lse)
    w_block = torch.where(both_empty, torch.zeros_like(diff), torch.sigmoid(diff))
    w_old = torch.where(both_empty, torch.zeros_like(diff), torch.sigmoid(-diff))
    new_out = (
        w_old.transpose(1, 2).unsqueeze(-1) * out
        + w_block.transpose(1, 2).unsqueeze(-1) * block_out
    )
    return new_out, torch.logaddexp(lse, block_lse)
