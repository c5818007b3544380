"""Mutants in shapes and constants: uneven tails, GQA head mapping, softmax scale."""

from __future__ import annotations

import torch

from ring_impl.mutants.base import mutant


def repeat_kv_heads(heads_q: int, heads_kv: int) -> torch.Tensor:
    """Query head h uses kv head h % Hkv (tensor.repeat), not h // g (repeat_interleave)."""
    return torch.arange(heads_q) % heads_kv


uneven_tail_dropped = mutant(
    "uneven-tail-dropped",
    """Every rank's K/V are truncated to the shortest shard before riding the ring, dropping the
    tail of longer shards (EasyContext #10/#47: sequence length must divide evenly). Visible with
    uneven shard lengths.""",
    kv_lengths=lambda lengths: [min(lengths)] * len(lengths),
)

gqa_repeat = mutant(
    "gqa-repeat",
    """Expands K/V heads with repeat (head h -> kv h % Hkv) instead of repeat_interleave
    (h -> h // g, flash-attn's convention). Visible for GQA with Hkv >= 2 and Hq > Hkv (not MHA,
    not MQA).""",
    kv_heads=repeat_kv_heads,
)

scale_one_over_d = mutant(
    "scale-one-over-d",
    """Softmax scale 1/head_dim instead of the given scale (default 1/sqrt(head_dim)); no single
    public report. Visible at any W unless the given scale happens to equal 1/head_dim.""",
    scale=lambda softmax_scale, head_dim: 1.0 / head_dim,
)
