"""Mutants in how partial results are merged and accumulated."""

from __future__ import annotations

import torch

from ring_impl.mutants.base import mutant


def _col(w: torch.Tensor) -> torch.Tensor:
    """(B, H, L) weights as (B, L, H, 1) to scale an output."""
    return w.transpose(1, 2).unsqueeze(-1)


def naive_sum(out, lse, block_out, block_lse):
    """Adds the normalised block outputs, ignoring their lse weights."""
    return out + block_out, torch.logaddexp(lse, block_lse)


def log1p_exp_merge(out, lse, block_out, block_lse):
    """The pre-fix formula: exp(block_lse - lse) overflows float32 once the gap passes ~88."""
    new_lse = lse + torch.log(1 + torch.exp(block_lse - lse))
    return _col(torch.exp(lse - new_lse)) * out + _col(
        torch.exp(block_lse - new_lse)
    ) * block_out, new_lse


def overwrite(out, lse, block_out, block_lse):
    """Keeps the newest block only: the last computed block overwrites the accumulator."""
    return block_out, block_lse


naive_merge_sum = mutant(
    "naive-merge-sum",
    """Sums normalised block outputs without lse weighting, the mistake the lse merge exists to avoid
    (cf. ring-flash-attention issue #20 on why partial results cannot simply be added). Visible
    whenever a query sees keys in two or more blocks.""",
    merge=naive_sum,
)

overflow_merge = mutant(
    "overflow-merge",
    """Merges with lse + log(1 + exp(block_lse - lse)), which overflows for lse gaps > ~88 and is NaN
    when lse = -inf (ring-flash-attention PR #30, "fix exp overflow when updating lse").
    Visible with large logits (scores ~100-200) or rows with no visible key in an earlier block.""",
    merge=log1p_exp_merge,
)

overwrite_merge = mutant(
    "overwrite-merge",
    """The last computed block overwrites out/lse instead of merging (long-context-attention /
    yunchang #176). Visible whenever a query sees keys in two or more blocks.""",
    merge=overwrite,
)

low_precision_accumulator = mutant(
    "low-precision-accumulator",
    """Accumulates out/lse in the input dtype (fp16/bf16) instead of float32, as ring implementations
    that merge flash-attn's low-precision block outputs directly do (ring-flash-attention README,
    "Limits"). Visible for fp16/bf16 inputs with W >= 2 (exact for fp32).""",
    acc_dtype=lambda dtype: dtype,
)
